package main

import (
	"context"
	"strconv"
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

// `dlq replay` says which consumer each replay is for, and warns before
// replaying a dead letter that records none: every consumer group on its
// topic would run it.
func TestDLQReplaySaysWhichConsumerAReplayIsFor(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	ids := seedDeadLetters(t, store) // no consumer recorded: two on orders, one on invoices
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"n":9}`))
	msg.Metadata.Set(metadata.EventID, "evt-9")
	msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
	msg.Metadata.Set(metadata.DeadLetterTopic, "orders.dlq")
	msg.Metadata.Set(metadata.DeadLetterConsumerGroup, "billing")
	msg.Metadata.Set(metadata.DeadLetterHandler, "charge")
	msg.Metadata.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
	msg.Metadata.Set(metadata.DeadLetterError, "customer unknown")
	msg.Metadata.Set(metadata.DeadLetterAttempts, "5")
	msg.Metadata.Set(metadata.DeadLetterLastFailure, time.Now().Format(time.RFC3339Nano))
	targeted, err := store.Insert(context.Background(), msg)
	require.NoError(t, err)

	out, err := runDLQ(t, s.URL, "replay", "--dry-run", "--topic", "orders")
	require.NoError(t, err, out)
	require.Contains(t, out, "would queue dead letter "+strconv.FormatInt(targeted, 10)+" ")
	require.Contains(t, out, "to orders for consumer billing/charge only")
	require.Contains(t, out, "warning: 2 replay(s) below name no consumer")
	require.Contains(t, out, "every consumer group on the topic receives the replay")
	require.Contains(t, out, "dead letter "+strconv.FormatInt(ids[0], 10)+" ")
	require.Contains(t, out, "to orders for every consumer group\n")

	out, err = runDLQ(t, s.URL, "replay", "--dry-run", "--id", strconv.FormatInt(targeted, 10))
	require.NoError(t, err, out)
	require.NotContains(t, out, "warning", "a replay for its recorded consumer needs no warning")

	// A renamed consumer: --for names its new name; '*' sends to all.
	out, err = runDLQ(t, s.URL, "replay", "--dry-run", "--id", strconv.FormatInt(targeted, 10), "--for", "billing-v2/charge")
	require.NoError(t, err, out)
	require.Contains(t, out, "for consumer billing-v2/charge only")
	out, err = runDLQ(t, s.URL, "replay", "--dry-run", "--id", strconv.FormatInt(targeted, 10), "--for", "*")
	require.NoError(t, err, out)
	require.Contains(t, out, "warning: 1 replay(s) below name no consumer")
	_, err = runDLQ(t, s.URL, "replay", "--dry-run", "--id", strconv.FormatInt(targeted, 10), "--for", "billing")
	require.ErrorContains(t, err, `replay for "billing": want`)
}
