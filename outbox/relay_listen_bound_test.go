package outbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn/pgconntest"
)

// A ListenURL server that accepts and never answers: the relay gives up on
// LISTEN after connect_timeout, says so, and polls; cancelled while it
// waits, Run returns at once (it waited forever before).
func TestRelay_SilentListenServer(t *testing.T) {
	t.Parallel()
	t.Run("connect_timeout", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		srv := pgconntest.Silent(t)
		logs := watermill.NewCaptureLogger()
		start := time.Now()
		startRelay(t, b.db, b.pubsub, RelayConfig{ListenURL: srv.URL("connect_timeout=1"), Logger: logs, PollInterval: 10 * time.Millisecond})
		require.Less(t, time.Since(start), 4*time.Second)
		require.Positive(t, srv.Accepted(), "the fault: the server accepted")
		var logged string
		for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
			if m.Msg == "outbox relay: LISTEN failed, polling only" {
				logged = m.Err.Error()
			}
		}
		require.Contains(t, logged, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")

		got := b.collect(t, "t")
		require.NoError(t, Add(context.Background(), b.db, Event{Topic: "t", AggregateID: "a"}))
		eventually(t, 5*time.Second, func() bool { return len(got.all()) == 1 }, "the relay polls")
	})
	t.Run("cancelled", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		srv := pgconntest.Silent(t)
		r, err := NewRelay(b.db, b.pubsub, RelayConfig{ListenURL: srv.URL("")}) // default 10s
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
		start := time.Now()
		select {
		case err = <-errc:
		case <-time.After(5 * time.Second):
			t.Fatal("Run still waiting on the silent ListenURL 5s after cancel")
		}
		require.Less(t, time.Since(start), time.Second)
		if err != nil {
			require.True(t, strings.Contains(err.Error(), "context canceled"), err.Error())
		}
		require.NoError(t, r.Close())
	})
}
