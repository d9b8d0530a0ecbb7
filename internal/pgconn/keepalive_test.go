package pgconn_test

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// keepalivesInDSN sets every keepalive setting in a DSN, so that no
// statement is sent to set them.
const keepalivesInDSN = "tcp_keepalives_idle=30&tcp_keepalives_interval=10&tcp_keepalives_count=3&tcp_user_timeout=60000"

// A server that goes silent after the startup cannot hang a new
// connection's keepalive settings: the connection gives up with the
// caller's context (or connect_timeout), saying what it was doing; a DSN
// that sets every keepalive itself sends no such statement.
func TestKeepaliveSettingsOnASilentServer(t *testing.T) {
	t.Parallel()
	t.Run("pq", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.AfterStartup(t)
		db, err := pgconn.Open(srv.URL("connect_timeout=5"))
		require.NoError(t, err)
		defer db.Close()
		errc := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			_, err := db.ExecContext(ctx, "SELECT 1")
			errc <- err
		}()
		<-srv.Waiting() // the fault: the server got the settings and stays silent
		require.Contains(t, strings.Join(pgconn.Waiting(), "; "), "postgres at "+srv.Addr()+": the session's keepalive settings (")
		select {
		case err = <-errc:
		case <-time.After(60 * time.Second):
			t.Fatal("the connection's keepalive settings ignored the deadline (still waiting 60s after it)")
		}
		require.ErrorContains(t, err, "postgres at "+srv.Addr()+": setting the new session's TCP keepalives")
		require.ErrorContains(t, err, "did not complete the session's keepalive settings within ")
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.AfterStartup(t)
		cfg, err := pgconn.PgxConfig(srv.URL("connect_timeout=1"))
		require.NoError(t, err)
		_, err = pgconn.ConnectPgx(context.Background(), cfg)
		require.Error(t, err)
		require.Positive(t, srv.Accepted(), "the fault: the server accepted")
		require.ErrorContains(t, err, "did not answer within 1s (connect_timeout")
	})
}

// Every session millwright opens over TCP has the keepalive settings of
// the package doc, on both drivers, unless its DSN (a parameter or
// options=-c) sets one; 0 in the DSN keeps the OS's value.
func TestSessionKeepalives(t *testing.T) {
	t.Parallel()
	defaults := map[string]string{
		"tcp_keepalives_idle":     strconv.Itoa(int(pgconn.KeepaliveIdle.Seconds())),
		"tcp_keepalives_interval": strconv.Itoa(int(pgconn.KeepaliveInterval.Seconds())),
		"tcp_keepalives_count":    strconv.Itoa(pgconn.KeepaliveCount),
		"tcp_user_timeout":        strconv.FormatInt(pgconn.KeepaliveUserTimeout.Milliseconds(), 10),
	}
	with := func(changes map[string]string) map[string]string {
		m := map[string]string{}
		for k, v := range defaults {
			m[k] = v
		}
		for k, v := range changes {
			m[k] = v
		}
		return m
	}
	cases := []struct {
		name  string
		extra string // appended to the URL's query
		want  map[string]string
	}{
		{"defaults", "", defaults},
		{"a DSN parameter is kept", "&tcp_keepalives_idle=7", with(map[string]string{"tcp_keepalives_idle": "7"})},
		{"options -c is kept", "&options=-c%20tcp_keepalives_count%3D5", with(map[string]string{"tcp_keepalives_count": "5"})},
		// 0 is the OS's value: current_setting shows what the socket has.
		{"0 turns it off", "&tcp_keepalives_idle=0&tcp_user_timeout=0", with(map[string]string{"tcp_keepalives_idle": osKeepaliveIdle(t), "tcp_user_timeout": "0"})},
	}
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				u := pgtest.BaseURL() + tc.extra
				got := map[string]string{}
				query := func(name string) string {
					return `SELECT setting FROM pg_settings WHERE name = '` + name + `'`
				}
				ctx := context.Background()
				if driver == pgtest.DriverPgx {
					p, err := pgconn.OpenPgx(ctx, u)
					require.NoError(t, err)
					defer p.Close()
					for name := range defaults {
						var v string
						require.NoError(t, p.QueryRow(ctx, query(name)).Scan(&v))
						got[name] = v
					}
				} else {
					db, err := pgconn.Open(u)
					require.NoError(t, err)
					defer db.Close()
					db.SetMaxOpenConns(1)
					for name := range defaults {
						var v string
						require.NoError(t, db.QueryRowContext(ctx, query(name)).Scan(&v))
						got[name] = v
					}
				}
				require.Equal(t, tc.want, got)
			})
		}
	})
}

// osKeepaliveIdle is what a TCP session shows for tcp_keepalives_idle
// when nobody set it: the OS's idle time.
func osKeepaliveIdle(t *testing.T) string {
	t.Helper()
	db, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	defer db.Close()
	var v string
	require.NoError(t, db.QueryRow(`SELECT setting FROM pg_settings WHERE name = 'tcp_keepalives_idle'`).Scan(&v))
	return v
}
