package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/metadata"
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
	s := pgtest.New(t, dlq.Migrations(), audit.Migrations())
	store := dlq.NewStore(s.DB)
	seedManyDeadLetters(t, store, 300)

	stdout, stderr, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "published 300 message(s)")
	require.Regexp(t, `(?m)^dlq replay: 30/300 messages \(10%\), [0-9.]+/s, about .* left`, stderr)
	require.Regexp(t, `(?m)^dlq replay: done, 300/300 messages \(100%\) in [^ ]+ \([0-9.]+/s\); 300 published$`, stderr)
	require.Equal(t, 0, pendingDeadLetters(t, store))
}

// Interrupted (the context SIGINT cancels), `dlq replay` says how far it
// got, which is what the table holds, and that re-running continues; the
// re-run replays exactly the rest.
func TestDLQReplayInterruptedSaysHowFar(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), audit.Migrations())
	store := dlq.NewStore(s.DB)
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

	m := regexp.MustCompile(`(?m)^dlq replay: stopped at (\d+)/300 messages \(\d+%\) after [^:]+: .*context canceled; re-running the same command continues safely: the (\d+) published are marked replayed and skipped$`).
		FindStringSubmatch(errOut.String())
	require.NotNil(t, m, "stderr:\n%s", errOut.String())
	replayed := 300 - pendingDeadLetters(t, store)
	require.Equal(t, strconv.Itoa(replayed), m[1], "the line says how far it got")
	require.Equal(t, m[1], m[2])
	require.Less(t, replayed, 300, "cancelled before the end")

	stdout, stderr, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "published "+strconv.Itoa(300-replayed)+" message(s); skipped "+strconv.Itoa(replayed)+" already replayed")
	require.Equal(t, 0, pendingDeadLetters(t, store))
}
