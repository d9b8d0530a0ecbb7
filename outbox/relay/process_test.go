package relay

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	tsql "github.com/millwright/millwright/transport/sql"
)

const (
	envChildURL  = "MILLWRIGHT_OUTBOX_CHILD_URL"
	envChildMove = "MILLWRIGHT_OUTBOX_CHILD_MOVE" // set: the child publishes in the database
)

// TestRelayChildProcess is not a test: it is the relay process that
// TestRelay_KilledProcessLosesNothing starts and kills with SIGKILL.
func TestRelayChildProcess(t *testing.T) {
	u := os.Getenv(envChildURL)
	if u == "" {
		t.Skip("helper process for TestRelay_KilledProcessLosesNothing")
	}
	db, err := sql.Open("postgres", u)
	require.NoError(t, err)
	if os.Getenv(envChildMove) != "" {
		tr, err := tsql.Open(context.Background(), tsql.Config{URL: u}, watermill.NopLogger{})
		require.NoError(t, err)
		// Lease: the parent's relay takes the lanes once it ends; long
		// enough that the server does not end the open move first.
		r, err := New(postgres.From(db), tr.Publisher(), Config{Lease: 2 * time.Second})
		require.NoError(t, err)
		r.mover.beforeCommit = func() {
			fmt.Println("published") // copied, not committed: the parent kills us now
			select {}
		}
		_ = r.Run(context.Background())
		return
	}
	r, err := New(postgres.From(db), gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}), Config{Lease: 300 * time.Millisecond})
	require.NoError(t, err)
	r.afterPublish = func(_ context.Context, published []int64) {
		fmt.Println("published", len(published)) // the parent kills us now
		select {}
	}
	_ = r.Run(context.Background())
}

// killChild starts TestRelayChildProcess with env and kills it (SIGKILL)
// once it prints a line starting with "published", which must be want.
// atKill, if not nil, runs just before the kill, while the child waits in
// its hook. A child that has not printed the line within 60 s is killed
// and the test fails.
func killChild(t *testing.T, want string, atKill func(), env ...string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestRelayChildProcess$", "-test.v")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	// The kill ends the scan below, which would otherwise wait forever.
	timer := time.AfterFunc(60*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()

	sc := bufio.NewScanner(out)
	var got string
	var before []string
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "published") {
			got = sc.Text()
			break
		}
		before = append(before, sc.Text())
	}
	require.NotEmpty(t, got, "the child relay never reached the point where it is killed (within 60s); its output:\n%s", strings.Join(before, "\n"))
	require.Equal(t, want, got, "the child relay's batch when killed")
	if atKill != nil {
		atKill()
	}
}

// TestRelay_KilledProcessPublishingInTheDatabaseLosesAndRepeatsNothing: a
// relay publishing in the database is killed (SIGKILL) with its batch
// copied into the topic's table but not committed. The server rolls the
// transaction back: no message, every row pending. The next relay
// publishes every event exactly once.
func TestRelay_KilledProcessPublishingInTheDatabaseLosesAndRepeatsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	topic := "killed_" + watermill.NewShortUUID()
	for i := 0; i < 20; i++ {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: topic, AggregateID: strconv.Itoa(i % 5)}))
	}
	killChild(t, "published", func() {
		// The child's uncommitted move holds every row: it copied all 20.
		var free int
		require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM (
			SELECT id FROM millwright_outbox FOR UPDATE SKIP LOCKED) x`).Scan(&free))
		require.Zero(t, free, "the killed relay's move held every row")
	}, envChildURL+"="+b.schema.URL, envChildMove+"="+topic)
	table := `"watermill_` + topic + `"`
	var messages int
	require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM `+table).Scan(&messages))
	require.Zero(t, messages, "the killed relay's copy was rolled back")
	require.Equal(t, 20, count(t, b.db, "status = 'pending'"), "and so was its mark")

	tr, err := tsql.Open(ctx, tsql.Config{DB: b.db}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	startRelay(t, b.db, tr.Publisher(), Config{PollInterval: 20 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "the next relay publishes the batch")
	var distinct int
	require.NoError(t, b.db.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM `+table).Scan(&messages, &distinct))
	require.Equal(t, 20, messages, "every event once")
	require.Equal(t, 20, distinct)
}

func TestRelay_KilledProcessLosesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: strconv.Itoa(i % 5)}))
	}

	// kill -9 between publish and mark, with the whole batch published
	// (one claim takes all 20: 5 aggregates' heads and their followers).
	killChild(t, "published 20", nil, envChildURL+"="+b.schema.URL)
	require.Equal(t, 0, count(t, b.db, "status = 'published'"), "the killed relay marked nothing")

	startRelay(t, b.db, b.pubsub, Config{PollInterval: 20 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "the killed batch is reclaimed after its lease")
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 20 }, "every event reaches the consumer")
}
