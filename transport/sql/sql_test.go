package sql_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"testing"
	"time"

	_ "github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/transport/sql"
)

// Open says what happened: a refusal at once, a silent server after
// ConnectTimeout, an interruption as soon as ctx ends; never "within 10s"
// for a refusal that took milliseconds.
func TestOpenSaysWhatHappened(t *testing.T) {
	t.Parallel()
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		addr := pgconntest.Refused(t)
		start := time.Now()
		// ConnectTimeout 2m: an Open that retried the refused port until
		// it passes the 60 s bound (1 s of wall clock measured the load).
		_, err := sql.Open(context.Background(), sql.Config{URL: "postgres://u:hunter2@" + addr + "/db?sslmode=disable", ConnectTimeout: 2 * time.Minute}, nil)
		require.Less(t, time.Since(start), 60*time.Second, "Open retried a refused port")
		require.ErrorContains(t, err, "postgres at "+addr+" refused the connection after ")
		require.ErrorContains(t, err, "check sql.Config.URL")
		require.NotContains(t, err.Error(), "within")
		require.NotContains(t, err.Error(), "hunter2")
	})
	t.Run("silent", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.Silent(t)
		start := time.Now()
		_, err := sql.Open(context.Background(), sql.Config{URL: srv.URL(""), ConnectTimeout: time.Second}, nil)
		require.Less(t, time.Since(start), 10*time.Second, "ConnectTimeout (1s) ended it, not the default (10s)")
		require.Positive(t, srv.Accepted())
		// Open's deadline or the pool's connect_timeout (ConnectTimeout
		// both), whichever fired first.
		require.ErrorContains(t, err, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1")
		require.NotContains(t, err.Error(), "hunter2")
	})
	t.Run("interrupted", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.Silent(t)
		ctx, cancel := context.WithCancelCause(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := sql.Open(ctx, sql.Config{URL: srv.URL(""), ConnectTimeout: 2 * time.Minute}, nil)
			errc <- err
		}()
		<-srv.Accepting()
		cancel(errors.New("interrupt signal received"))
		var err error
		select {
		case err = <-errc:
		case <-time.After(60 * time.Second):
			// ConnectTimeout is 2m: only the cancel ends it sooner.
			t.Fatal("Open ignored the cancelled context (still waiting 60s after it; ConnectTimeout 2m)")
		}
		require.ErrorContains(t, err, "interrupted while connecting to postgres at "+srv.Addr())
		require.ErrorContains(t, err, "interrupt signal received")
	})
	// A pool the caller opened with plain lib/pq cannot be interrupted
	// inside lib/pq: Open still returns after ConnectTimeout, saying so.
	t.Run("silent shared pool", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.Silent(t)
		db, err := stdsql.Open("postgres", srv.URL(""))
		require.NoError(t, err)
		defer db.Close()
		start := time.Now()
		_, err = sql.Open(context.Background(), sql.Config{DB: db, ConnectTimeout: time.Second}, nil)
		require.Less(t, time.Since(start), 10*time.Second, "ConnectTimeout (1s) ended it, not the default (10s)")
		require.ErrorContains(t, err, "postgres did not answer within 1s")
	})
}
