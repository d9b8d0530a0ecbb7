package outboxtest_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

func TestWaitDrained(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx := context.Background()
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)), "an empty outbox is drained")

	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "t", AggregateID: "a", Payload: []byte(`{}`)}))
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err := outboxtest.WaitDrained(short, postgres.From(s.DB))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "1 pending")

	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r, err := relay.New(postgres.From(s.DB), ps, relay.Config{PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	go func() { _ = r.Run(ctx) }()
	defer r.Close()
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	require.NoError(t, outboxtest.WaitDrained(wctx, postgres.From(s.DB)))

	_, err = s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status) VALUES ('x', 't', 'b', '{}', 'failed')`)
	require.NoError(t, err)
	require.ErrorIs(t, outboxtest.WaitDrained(wctx, postgres.From(s.DB)), outboxtest.ErrFailedEvents)
}

// WaitDrained reads through a pgx pool as well (any outbox.Executor).
func TestWaitDrained_Pgx(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx := context.Background()
	p := s.Pgx(t)
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(p), outbox.Event{Topic: "t", AggregateID: "a", Payload: []byte(`{}`)}))
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err := outboxtest.WaitDrained(short, postgres.From(p))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "1 pending")
	_, err = p.Exec(ctx, `UPDATE millwright_outbox SET status = 'failed'`)
	require.NoError(t, err)
	require.ErrorIs(t, outboxtest.WaitDrained(ctx, postgres.From(p)), outboxtest.ErrFailedEvents)
}
