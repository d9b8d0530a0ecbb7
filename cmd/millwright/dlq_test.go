package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// runDLQ runs `millwright dlq args...` against the schema (stdin not a
// terminal) and returns its stdout and stderr.
func runDLQ(t *testing.T, url string, args ...string) (string, error) {
	t.Helper()
	stdout, stderr, err := runCLI(t, dlqCmd(), nil, url, args...)
	return stdout + stderr, err
}

func seedDeadLetters(t *testing.T, db *dlq.Store) []int64 {
	t.Helper()
	var ids []int64
	for i, topic := range []string{"orders", "orders", "invoices"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"n":`+strconv.Itoa(i)+`}`))
		msg.Metadata.Set(metadata.EventID, "evt-"+strconv.Itoa(i))
		msg.Metadata.Set(metadata.DeadLetterOriginalTopic, topic)
		msg.Metadata.Set(metadata.DeadLetterTopic, topic+".dlq")
		msg.Metadata.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
		msg.Metadata.Set(metadata.DeadLetterError, "failure number "+strconv.Itoa(i))
		msg.Metadata.Set(metadata.DeadLetterAttempts, "5")
		msg.Metadata.Set(metadata.DeadLetterLastFailure, time.Now().Add(-time.Duration(3-i)*time.Hour).Format(time.RFC3339Nano))
		if i == 0 {
			msg.Metadata.Set(metadata.DeadLetterStack, "goroutine 1 [running]:\nmain.charge()")
		}
		id, err := db.Insert(context.Background(), msg)
		require.NoError(t, err)
		ids = append(ids, id)
	}
	return ids
}

func TestDLQCommands(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	ids := seedDeadLetters(t, store)

	out, err := runDLQ(t, s.URL, "list", "--topic", "orders")
	require.NoError(t, err)
	require.Contains(t, out, "failure number 0")
	require.Contains(t, out, "failure number 1")
	require.NotContains(t, out, "failure number 2")

	out, err = runDLQ(t, s.URL, "list", "--error", "NUMBER 2", "--since", "90m")
	require.NoError(t, err)
	require.Contains(t, out, "failure number 2")
	require.Equal(t, 2, strings.Count(out, "\n"), "header and one row:\n%s", out)

	out, err = runDLQ(t, s.URL, "show", strconv.FormatInt(ids[0], 10))
	require.NoError(t, err)
	require.Contains(t, out, "failure number 0")
	require.Contains(t, out, `{"n":0}`)
	require.Contains(t, out, "main.charge()")
	require.Contains(t, out, "ce_id: evt-0")

	_, err = runDLQ(t, s.URL, "show", "999999")
	require.ErrorIs(t, err, dlq.ErrNotFound)

	_, err = runDLQ(t, s.URL, "replay", "--dry-run")
	require.ErrorContains(t, err, "no filter given")

	out, err = runDLQ(t, s.URL, "replay", "--dry-run", "--all", "--target", "orders.retry")
	require.NoError(t, err)
	for _, id := range ids {
		require.Contains(t, out, "would queue dead letter "+strconv.FormatInt(id, 10)+" ")
	}
	require.Contains(t, out, "to orders.retry")
	require.Contains(t, out, "would queue 3 message(s)")
	require.Contains(t, out, "nothing queued")
	pending, err := store.Count(context.Background(), dlq.Filter{Pending: true})
	require.NoError(t, err)
	require.Equal(t, 3, pending, "dry run marked nothing")

	out, err = runDLQ(t, s.URL, "replay", "--topic", "orders", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, out)
	require.Contains(t, out, "queued 2 message(s)")
	out, err = runDLQ(t, s.URL, "replay", "--topic", "orders", "--transport", "mem://", "--yes")
	require.NoError(t, err, out)
	require.Contains(t, out, "queued 0 message(s); skipped 2 already replayed")
}

// A dead letter resolved through park (its message applied later) shows
// its state, leaves --pending, and is not replayed without --force.
func TestDLQResolvedState(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	store := dlq.NewStore(postgres.From(s.DB))
	ids := seedDeadLetters(t, store)
	var ok bool
	err := postgres.SQL(s.DB).InTx(context.Background(), func(tx postgres.Tx) (err error) {
		ok, err = dlq.ResolveTx(context.Background(), tx, ids[0], dlq.Resolution{Actor: "park retrier/billing"})
		return err
	})
	require.NoError(t, err)
	require.True(t, ok)

	out, err := runDLQ(t, s.URL, "list", "--topic", "orders")
	require.NoError(t, err)
	require.Contains(t, out, "STATE")
	require.Contains(t, out, "resolved")
	out, err = runDLQ(t, s.URL, "list", "--topic", "orders", "--pending")
	require.NoError(t, err)
	require.NotContains(t, out, "failure number 0", "a resolved dead letter is not pending")
	require.Contains(t, out, "failure number 1")
	out, err = runDLQ(t, s.URL, "show", strconv.FormatInt(ids[0], 10))
	require.NoError(t, err)
	require.Contains(t, out, "resolved")
	out, err = runDLQ(t, s.URL, "replay", "--id", strconv.FormatInt(ids[0], 10), "--dry-run")
	require.NoError(t, err)
	require.NotContains(t, out, "would queue dead letter "+strconv.FormatInt(ids[0], 10), "not replayed unless forced:\n%s", out)
	out, err = runDLQ(t, s.URL, "replay", "--id", strconv.FormatInt(ids[0], 10), "--dry-run", "--force")
	require.NoError(t, err)
	require.Contains(t, out, "would queue dead letter "+strconv.FormatInt(ids[0], 10), "forced:\n%s", out)
	entries, err := audit.List(context.Background(), postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	require.NotEmpty(t, entries)
	require.Equal(t, dlq.ResolveCommand, entries[len(entries)-1].Command, "the resolution's audit row")
}
