package relay

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// A ListenURL server that accepts and never answers: the relay gives up on
// LISTEN after connect_timeout, says so, and polls; cancelled while it
// waits, Run returns at once (it waited forever before). On a pgx pool the
// relay's connections on ListenURL are pgx's, bounded the same way.
func TestRelay_SilentListenServer(t *testing.T) {
	t.Parallel()
	t.Run("connect_timeout", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		srv := pgconntest.Silent(t)
		logged := silentListen(t, b.db, b, srv.URL("connect_timeout=1"))
		require.Positive(t, srv.Accepted(), "the fault: the server accepted")
		require.Contains(t, logged, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")

	})
	t.Run("connect_timeout_pgx", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		srv := pgconntest.Silent(t)
		logged := silentListen(t, b.schema.Pgx(t), b, srv.URL("connect_timeout=1"))
		require.Positive(t, srv.Accepted(), "the fault: the server accepted")
		require.Contains(t, logged, "relay.Config.ListenURL")
	})
	for _, driver := range []string{pgtest.DriverPQ, pgtest.DriverPgx} {
		t.Run("cancelled_"+driver, func(t *testing.T) {
			t.Parallel()
			b := setupDriver(t, driver)
			srv := pgconntest.Silent(t)
			// connect_timeout=120: only the cancel can end the LISTEN's
			// connect within the 60 s bound below.
			r, err := newRelayOn(b.handle, b.pubsub, Config{ListenURL: srv.URL("connect_timeout=120")})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			go func() { errc <- r.Run(ctx) }()
			select {
			case <-srv.Accepting():
			case <-time.After(10 * time.Second):
				t.Fatal("the relay did not connect to ListenURL")
			}
			cancel()
			select {
			case err = <-errc:
			case <-time.After(60 * time.Second):
				t.Fatal("Run still waiting on the silent ListenURL 60s after cancel (connect_timeout 120s)")
			}
			if err != nil {
				require.True(t, strings.Contains(err.Error(), "context canceled"), err.Error())
			}
			require.NoError(t, r.Close())
		})
	}
}

// silentListen starts a relay on h with ListenURL url (a silent server),
// checks that it starts within connect_timeout and polls, and returns the
// error it logged for LISTEN.
func silentListen(t *testing.T, h any, b bundle, url string) string {
	t.Helper()
	logs := watermill.NewCaptureLogger()
	start := time.Now()
	startRelayOn(t, h, b.pubsub, Config{ListenURL: url, Logger: logs, PollInterval: 10 * time.Millisecond})
	// The URL's connect_timeout=1 ended the LISTEN's attempt, not the
	// default 10s (a 4 s bound measured the machine's load).
	require.Less(t, time.Since(start), 10*time.Second)
	var logged string
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if m.Msg == "outbox relay: LISTEN failed, polling only" {
			logged = m.Err.Error()
		}
	}
	require.NotEmpty(t, logged, "LISTEN's failure is logged")
	got := b.collect(t, "t")
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.SQL(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "the relay polls")
	return logged
}
