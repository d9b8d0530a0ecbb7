package outbox

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"
)

const envChildURL = "MILLWRIGHT_OUTBOX_CHILD_URL"

// TestRelayChildProcess is not a test: it is the relay process that
// TestRelay_KilledProcessLosesNothing starts and kills with SIGKILL.
func TestRelayChildProcess(t *testing.T) {
	u := os.Getenv(envChildURL)
	if u == "" {
		t.Skip("helper process for TestRelay_KilledProcessLosesNothing")
	}
	db, err := sql.Open("postgres", u)
	require.NoError(t, err)
	r, err := NewRelay(db, gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}), RelayConfig{Lease: 300 * time.Millisecond})
	require.NoError(t, err)
	r.afterPublish = func(_ context.Context, published []int64) {
		fmt.Println("published", len(published)) // the parent kills us now
		select {}
	}
	_ = r.Run(context.Background())
}

func TestRelay_KilledProcessLosesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		require.NoError(t, Add(ctx, b.db, Event{Topic: "t", AggregateID: strconv.Itoa(i % 5)}))
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestRelayChildProcess$", "-test.v")
	cmd.Env = append(os.Environ(), envChildURL+"="+b.schema.URL)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if len(sc.Text()) > 9 && sc.Text()[:9] == "published" {
			break
		}
	}
	require.NoError(t, cmd.Process.Kill()) // kill -9 between publish and mark
	_ = cmd.Wait()
	require.Equal(t, 0, count(t, b.db, "status = 'published'"), "the killed relay marked nothing")

	startRelay(t, b.db, b.pubsub, RelayConfig{PollInterval: 20 * time.Millisecond})
	eventually(t, 10*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "the killed batch is reclaimed after its lease")
	eventually(t, 5*time.Second, func() bool { return len(got.all()) == 20 }, "every event reaches the consumer")
}
