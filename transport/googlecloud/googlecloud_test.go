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
		start := time.Now()
		_, err := googlecloud.Open(context.Background(), cfg(addr), nil)
		require.Less(t, time.Since(start), 500*time.Millisecond)
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
		require.Less(t, took, 5*time.Second)
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
		start := time.Now()
		var err error
		select {
		case err = <-errc:
		case <-time.After(5 * time.Second):
			t.Fatal("Open ignored the cancelled context")
		}
		require.Less(t, time.Since(start), time.Second)
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
