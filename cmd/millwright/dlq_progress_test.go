package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// seedManyDeadLetters stores n dead letters of topic "orders".
func seedManyDeadLetters(t *testing.T, store *dlq.Store, n int) {
	t.Helper()
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"n":`+strconv.Itoa(i)+`}`))
		msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
		msg.Metadata.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
		msg.Metadata.Set(metadata.DeadLetterError, "boom")
		_, err := store.Insert(context.Background(), msg)
		require.NoError(t, err)
	}
}

// `dlq replay` of a few hundred dead letters through the gochannel
// transport reports done/total on stderr as it goes (stderr is not a
// terminal: plain lines, one per tenth at this pace) and ends with the
// summary.
func TestDLQReplayProgress(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	store := dlq.NewStore(postgres.From(s.DB))
	seedManyDeadLetters(t, store, 300)

	stdout, stderr, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "queued 300 message(s)")
	require.Regexp(t, `(?m)^dlq replay: 30/300 messages \(10%\), [0-9.]+/s, about .* left`, stderr)
	require.Regexp(t, `(?m)^dlq replay: done, 300/300 messages \(100%\) in [^ ]+ \([0-9.]+/s\); 300 queued$`, stderr)
	require.Equal(t, 0, pendingDeadLetters(t, store))
}

// Interrupted (the context SIGINT cancels), `dlq replay` says how far it
// got, which is what the table holds, and that re-running continues; the
// re-run replays exactly the rest.
func TestDLQReplayInterruptedSaysHowFar(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	store := dlq.NewStore(postgres.From(s.DB))
	seedManyDeadLetters(t, store, 300)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := dlqCmd()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetIn(strings.NewReader(""))
	cmd.SetArgs([]string{"replay", "--all", "--transport", "mem://", "--rate", "50", "--yes", "--database-url", s.URL})
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()

	// Cancel once at least 20 are replayed (at 50/s the 300 take 6 s).
	deadline := time.Now().Add(time.Minute)
	for {
		replayed := 300 - pendingDeadLetters(t, store)
		if replayed >= 20 {
			break
		}
		require.True(t, time.Now().Before(deadline), "replay did not reach 20 in a minute (at %d); stderr:\n%s", replayed, errOut.String())
		time.Sleep(10 * time.Millisecond) // polling the table, bounded above
	}
	cancel()
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		t.Fatal("dlq replay did not return within a minute of the cancel")
	}
	require.ErrorIs(t, err, context.Canceled)

	replayed := requireStoppedLine(t, errOut.String(), store, "context canceled")
	require.Less(t, replayed, 300, "cancelled before the end")

	stdout, stderr, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "queued "+strconv.Itoa(300-replayed)+" message(s); skipped "+strconv.Itoa(replayed)+" already replayed")
	require.Equal(t, 0, pendingDeadLetters(t, store))
}

// The real binary, interrupted by SIGINT mid-replay, says how far it got
// (what the table holds) and that re-running continues, and still writes
// its audit row with that count.
func TestDLQReplaySIGINTSaysHowFar(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	store := dlq.NewStore(postgres.From(s.DB))
	seedManyDeadLetters(t, store, 300)
	bin := pgconntest.Build(t, ".")

	p := pgconntest.Start(t, bin, nil, "dlq", "replay", "--all", "--transport", "mem://", "--rate", "50", "--yes", "--database-url", s.URL)
	deadline := time.Now().Add(time.Minute)
	for 300-pendingDeadLetters(t, store) < 20 {
		require.True(t, time.Now().Before(deadline), "replay did not reach 20 in a minute")
		time.Sleep(10 * time.Millisecond) // polling the table, bounded above
	}
	p.Signal(t, syscall.SIGINT)
	_, code, out, ok := p.Wait(30 * time.Second)
	require.True(t, ok, "still running 30 s after SIGINT:\n%s", out)
	require.Equal(t, 1, code, out)

	replayed := requireStoppedLine(t, out, store, "interrupt signal received")
	rows := auditRows(t, s)
	require.Len(t, rows, 1, out)
	require.EqualValues(t, replayed, rows[0].Affected)
	require.Contains(t, rows[0].Error, "interrupt")
	require.Len(t, itemAuditRows(t, s), replayed, "one row per dead letter queued, committed with it")
}

// requireStoppedLine checks the line of a replay of 300 that stopped: it
// names why and says how far it got, which is what the table holds (a
// commit the signal cut is read back, so it counts when it was applied).
// It returns the rows replayed.
func requireStoppedLine(t *testing.T, out string, store *dlq.Store, why string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^dlq replay: stopped at (\d+)/300 messages \(\d+%\) after [^:]+: (.*); re-running the same command continues safely: the (\d+) queued are marked replayed and skipped$`).
		FindStringSubmatch(out)
	require.NotNil(t, m, "output:\n%s", out)
	require.Contains(t, m[2], why, "the line says why it stopped")
	require.Equal(t, m[1], m[3])
	replayed := 300 - pendingDeadLetters(t, store)
	said, _ := strconv.Atoi(m[1])
	require.Equal(t, replayed, said, "the line says how far it got")
	return replayed
}
