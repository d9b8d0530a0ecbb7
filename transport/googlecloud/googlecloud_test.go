package googlecloud_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/transport/googlecloud"
)

// Open says what happened to its first contact: a refused emulator port
// fails at once saying "refused" (it waited the whole ConnectTimeout and
// said "did not answer"), a silent one after ConnectTimeout saying "did
// not answer", and a cancelled ctx at once saying "interrupted".
func TestOpenSaysWhatHappened(t *testing.T) {
	t.Parallel()
	cfg := func(host string) googlecloud.Config {
		return googlecloud.Config{ProjectID: "p-project", EmulatorHost: host, ConnectTimeout: 2 * time.Second}
	}
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		addr := pgconntest.Refused(t)
		// A 2-minute ConnectTimeout: an Open that waited it out on the
		// refused port (the bug) passes the 60 s bound; 500 ms of wall
		// clock measured the machine's load.
		c := cfg(addr)
		c.ConnectTimeout = 2 * time.Minute
		start := time.Now()
		_, err := googlecloud.Open(context.Background(), c, nil)
		require.Less(t, time.Since(start), 60*time.Second, "Open waited out ConnectTimeout on a refused port")
		require.ErrorContains(t, err, "googlecloud: the Pub/Sub emulator at "+addr+" refused the connection (is the emulator running there? check googlecloud.Config.EmulatorHost)")
		require.ErrorContains(t, err, "connection refused")
		require.NotContains(t, err.Error(), "did not answer")
	})
	t.Run("silent", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.Silent(t)
		start := time.Now()
		_, err := googlecloud.Open(context.Background(), cfg(srv.Addr()), nil)
		took := time.Since(start)
		require.GreaterOrEqual(t, took, 2*time.Second-100*time.Millisecond)
		// ConnectTimeout (2s) ended it, not the default (10s).
		require.Less(t, took, 10*time.Second)
		require.Positive(t, srv.Accepted(), "the fault: the port accepted")
		require.ErrorContains(t, err, "googlecloud: Pub/Sub for project p-project (emulator at "+srv.Addr()+") did not answer within 2s (ConnectTimeout")
	})
	t.Run("interrupted", func(t *testing.T) {
		t.Parallel()
		srv := pgconntest.Silent(t)
		ctx, cancel := context.WithCancelCause(context.Background())
		errc := make(chan error, 1)
		c := cfg(srv.Addr())
		c.ConnectTimeout = time.Minute
		go func() {
			_, err := googlecloud.Open(ctx, c, nil)
			errc <- err
		}()
		<-srv.Accepting() // the TCP check; gRPC connects next
		cancel(errors.New("terminated signal received"))
		var err error
		select {
		case err = <-errc:
		case <-time.After(30 * time.Second):
			// ConnectTimeout is a minute: only the cancel ends it sooner.
			t.Fatal("Open ignored the cancelled context (still waiting 30s after it; ConnectTimeout 1m)")
		}
		require.ErrorContains(t, err, "interrupted while waiting for ")
		require.ErrorContains(t, err, "terminated signal received")
	})
	t.Run("emulator", func(t *testing.T) {
		t.Parallel()
		host := os.Getenv("MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST")
		if host == "" {
			host = "127.0.0.1:8085"
		}
		if host == "fake" {
			t.Skip("MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST=fake")
		}
		tr, err := googlecloud.Open(context.Background(), cfg(host), nil)
		require.NoError(t, err, "is the emulator running at %s? (scripts/services.sh up)", host)
		require.NoError(t, tr.Close())
	})
}
