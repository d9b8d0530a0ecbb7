package pgconn_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// unsetenv unsets key for the test (t.Setenv restores it after).
func unsetenv(t *testing.T, key string) {
	t.Setenv(key, "")
	require.NoError(t, os.Unsetenv(key))
}

func TestWithConnectTimeout(t *testing.T) {
	unsetenv(t, "PGCONNECT_TIMEOUT")
	for _, c := range []struct{ in, want string }{
		{"postgres://u@h:5432/db?sslmode=disable", "postgres://u@h:5432/db?connect_timeout=10&sslmode=disable"},
		{"postgresql://u@h/db", "postgresql://u@h/db?connect_timeout=10"},
		{"postgres://u@h/db?connect_timeout=3", "postgres://u@h/db?connect_timeout=3"},
		{"postgres://u@h/db?connect_timeout=0", "postgres://u@h/db?connect_timeout=0"}, // libpq's "no limit", kept
		{"host=h dbname=db", "host=h dbname=db connect_timeout=10"},
		{"host=h connect_timeout=2", "host=h connect_timeout=2"},
		{"", "connect_timeout=10"},
	} {
		require.Equal(t, c.want, pgconn.WithConnectTimeout(c.in, 0), c.in)
	}
	require.Equal(t, "host=h connect_timeout=2", pgconn.WithConnectTimeout("host=h", 1500*time.Millisecond), "rounded up to whole seconds")

	t.Setenv("PGCONNECT_TIMEOUT", "4")
	require.Equal(t, "host=h", pgconn.WithConnectTimeout("host=h", 0), "PGCONNECT_TIMEOUT is the user's choice")
}

// A server that accepts and never answers: the attempt ends after
// connect_timeout, saying so.
func TestSilentServerFailsAfterConnectTimeout(t *testing.T) {
	t.Parallel()
	srv := pgconntest.Silent(t)
	db, err := pgconn.Open(srv.URL("connect_timeout=1"))
	require.NoError(t, err)
	defer db.Close()

	start := time.Now()
	err = db.PingContext(context.Background())
	elapsed := time.Since(start)
	require.Error(t, err)
	require.Positive(t, srv.Accepted(), "the fault: the server accepted")
	require.GreaterOrEqual(t, elapsed, 900*time.Millisecond)
	// The URL's 1s ended the attempt, not the default (10s) a URL without
	// connect_timeout gets: bounded by the default, not by how fast a
	// loaded machine answers.
	require.Less(t, elapsed, pgconn.DefaultConnectTimeout)
	require.Contains(t, err.Error(), "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")
	require.NotContains(t, err.Error(), "hunter2")
}

// Without connect_timeout in the URL the default applies: the connector
// is built with 10s.
func TestDefaultConnectTimeoutApplies(t *testing.T) {
	unsetenv(t, "PGCONNECT_TIMEOUT")
	cfg, err := pq.NewConfig(pgconn.WithConnectTimeout("postgres://u@127.0.0.1/db", 0))
	require.NoError(t, err)
	require.Equal(t, pgconn.DefaultConnectTimeout, cfg.ConnectTimeout)
}

// Cancelling the context ends a connection attempt stuck in the startup
// exchange at once (lib/pq alone keeps reading until connect_timeout): with
// connect_timeout=120, only the cancel can end it within the 60 s bound.
func TestCancelInterruptsConnect(t *testing.T) {
	t.Parallel()
	srv := pgconntest.Silent(t)
	db, err := pgconn.Open(srv.URL("connect_timeout=120"))
	require.NoError(t, err)
	defer db.Close()

	ctx, cancel := context.WithCancelCause(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- db.PingContext(ctx) }()
	<-srv.Accepting()
	waiting := strings.Join(pgconn.Waiting(), "; ")
	require.Contains(t, waiting, "postgres at "+srv.Addr()+": connecting (")
	cancel(errors.New("interrupt signal received"))
	select {
	case err = <-errc:
	case <-time.After(60 * time.Second):
		t.Fatal("PingContext ignored the cancelled context (still connecting 60s after it; connect_timeout 120s)")
	}
	// "(no answer after 2ms)", or "(TCP connect pending after ...)" when
	// the cancel beat the client's side of the accept.
	require.ErrorContains(t, err, "interrupted while connecting to postgres at "+srv.Addr()+" (")
	require.ErrorContains(t, err, "interrupt signal received")
	require.NotContains(t, strings.Join(pgconn.Waiting(), "; "), srv.Addr(), "nothing left in flight")
}

// A refused port fails at once and says "refused", never "did not answer":
// with connect_timeout=120, a retry of the refused port until
// connect_timeout would pass the 60 s bound.
func TestRefusedFailsAtOnce(t *testing.T) {
	t.Parallel()
	addr := pgconntest.Refused(t)
	db, err := pgconn.Open("postgres://u:hunter2@" + addr + "/db?sslmode=disable&connect_timeout=120")
	require.NoError(t, err)
	defer db.Close()
	start := time.Now()
	err = db.PingContext(context.Background())
	require.Less(t, time.Since(start), 60*time.Second, "the refused port was retried until connect_timeout")
	require.ErrorContains(t, err, "postgres at "+addr+" refused the connection after ")
	require.ErrorContains(t, err, "connection refused")
	require.NotContains(t, err.Error(), "did not answer")
}

// A server that stops answering after the startup: a cancelled statement
// returns at once (lib/pq alone would wait for the answer to its cancel
// request forever), and a deadline says it passed.
func TestSilentStatementIsInterrupted(t *testing.T) {
	t.Parallel()
	t.Run("cancel", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.AfterStartup(t)
		// The DSN sets the keepalives, so the statement below is the
		// first the silent server gets (TestKeepaliveSettingsOnASilentServer
		// covers the connection's own).
		db, err := pgconn.Open(srv.URL("connect_timeout=5&" + keepalivesInDSN))
		require.NoError(t, err)
		defer db.Close()
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := db.ExecContext(ctx, "SELECT 1")
			errc <- err
		}()
		<-srv.Waiting()
		require.Contains(t, strings.Join(pgconn.Waiting(), "; "), "postgres at "+srv.Addr()+": a statement (")
		cancel()
		select {
		case err = <-errc:
		case <-time.After(60 * time.Second):
			// The server never answers: without the fix this waits forever.
			t.Fatal("ExecContext ignored the cancelled context (still waiting 60s after it)")
		}
		require.ErrorContains(t, err, "interrupted while waiting for postgres at "+srv.Addr()+" to answer a statement (after ")
		require.ErrorIs(t, err, context.Canceled)
	})
	t.Run("deadline", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.AfterStartup(t)
		// The DSN sets the keepalives, so the statement below is the
		// first the silent server gets (TestKeepaliveSettingsOnASilentServer
		// covers the connection's own).
		db, err := pgconn.Open(srv.URL("connect_timeout=5&" + keepalivesInDSN))
		require.NoError(t, err)
		defer db.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		var n int
		err = db.QueryRowContext(ctx, "SELECT 1").Scan(&n)
		require.ErrorContains(t, err, "postgres at "+srv.Addr()+" did not complete a query within ")
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})
}

// The Listener's connection attempts end with its context, so Close and
// Listen return at once instead of after connect_timeout (120 s here, so
// that only the context can end them within the 60 s bound).
func TestListenerStopsWithContext(t *testing.T) {
	t.Parallel()
	srv := pgconntest.Silent(t)
	ctx, cancel := context.WithCancel(context.Background())
	l := pgconn.NewListener(ctx, srv.URL("connect_timeout=120"), 10*time.Millisecond, 50*time.Millisecond, nil)
	listened := make(chan error, 1)
	go func() { listened <- l.Listen("ch") }()
	<-srv.Accepting()
	cancel()
	closed := make(chan error, 1)
	go func() { closed <- l.Close() }()
	bound := time.After(60 * time.Second)
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-bound:
		t.Fatal("Close still blocked 60s after the cancel (connect_timeout 120s)")
	}
	select {
	case err := <-listened:
		require.Error(t, err)
	case <-bound:
		t.Fatal("Listen still blocked 60s after the cancel and Close (connect_timeout 120s)")
	}
}

// On a real server: statements, transactions and LISTEN work through the
// wrapper, and a cancelled statement leaves the pool usable.
func TestRealServer(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	db, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	defer db.Close()
	db.SetMaxOpenConns(2)
	ctx := context.Background()

	_, err = db.ExecContext(ctx, `CREATE TABLE t (v int)`)
	require.NoError(t, err)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (2)`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT sum(v) FROM t`).Scan(&n))
	require.Equal(t, 1, n)

	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = db.ExecContext(cctx, `SELECT pg_sleep(120)`)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	// The deadline, not the statement's end, returned it: well before the
	// 120 s sleep, however loaded the machine.
	require.Less(t, time.Since(start), 60*time.Second)
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM t`).Scan(&n), "the pool recovers")

	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	l := pgconn.NewListener(lctx, s.URL, 10*time.Millisecond, time.Second, nil)
	defer l.Close()
	require.NoError(t, l.Listen("pgconn_test"))
	_, err = db.ExecContext(ctx, `NOTIFY pgconn_test, 'hi'`)
	require.NoError(t, err)
	select {
	case nt := <-l.Notify:
		require.Equal(t, "hi", nt.Extra)
	case <-time.After(10 * time.Second):
		t.Fatal("no notification")
	}
}

// ConnectPgx says what a failed connect was in Open's words: a silent
// server after connect_timeout, a refused port at once.
func TestConnectPgxNamesTheFailure(t *testing.T) {
	t.Parallel()
	srv := pgconntest.Silent(t)
	cfg, err := pgconn.PgxConfig(srv.URL("connect_timeout=1"))
	require.NoError(t, err)
	start := time.Now()
	_, err = pgconn.ConnectPgx(context.Background(), cfg)
	require.Error(t, err)
	require.Positive(t, srv.Accepted(), "the fault: the server accepted")
	require.Less(t, time.Since(start), pgconn.DefaultConnectTimeout, "the URL's connect_timeout=1 ended it, not the default")
	require.ErrorContains(t, err, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")
	require.NotContains(t, err.Error(), "hunter2")

	cfg, err = pgconn.PgxConfig("postgres://u:hunter2@127.0.0.1:1/x?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	_, err = pgconn.ConnectPgx(context.Background(), cfg)
	require.ErrorContains(t, err, "postgres at 127.0.0.1:1 refused the connection after ")
	require.NotContains(t, err.Error(), "hunter2")
}
