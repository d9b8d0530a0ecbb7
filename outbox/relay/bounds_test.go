package relay

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// A dead-letter copy to a broker that does not answer holds the round at
// most about a Lease: the relay stops waiting (the call, which here
// ignores its message's context, is left running and counted), the row
// stays failed, and the relay stands aside until the call returns.
func TestRelay_DeadLetterWaitIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{}`)}))
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, _ *message.Message) error {
		if topic == "orders" {
			return errors.New("message too large")
		}
		entered <- struct{}{}
		<-release // a broker that never answers, and a client that does not give up
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{DeadLetterTopic: "orders.dead", Retry: retryOnce, Lease: time.Second})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { _, err := r.RunOnce(ctx); done <- err }()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the dead letter was never sent")
	}
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the round still waits for the dead-letter copy after 30s (Lease 1s)")
	}
	require.Equal(t, 1, count(t, b.db, "status = 'failed'"))
	require.EqualValues(t, 1, r.stuck.Load(), "the call left running is not counted")
	_, err = r.RunOnce(ctx)
	require.ErrorContains(t, err, "holds no lanes until they return", "the relay does not stand aside while the call runs")
	close(release)
	eventually(t, 30*time.Second, func() bool { return r.stuck.Load() == 0 }, "the call's return was not counted")
	_, err = r.RunOnce(ctx)
	require.NoError(t, err)
}

// A lane check that cannot finish (here the lanes' table is locked by
// another session) ends after a Lease with an error instead of holding the
// relay until the lock goes.
func TestRelay_LaneCheckIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	_, err = tx.Exec(`LOCK TABLE millwright_outbox_lanes IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	r, err := New(postgres.From(b.db), b.pubsub, Config{Lease: 500 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { _, err := r.RunOnce(ctx); done <- err }()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "holding lanes")
	case <-time.After(30 * time.Second):
		t.Fatal("the lane check still waits for the lock after 30s (Lease 0.5s)")
	}
}

// Once the dead-letter copies' bound (a Lease) has passed, the round's
// remaining copies are skipped, logged, not started: each would wait its
// grace and pile up as one more stuck call. Five rows of five aggregates
// fail for good in one round against a dead-letter broker that never
// answers: one call is started (it holds past the bound), the other four
// are skipped, and every row is failed with its event kept.
func TestRelay_DeadLetterCopiesStopAtTheirBound(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for i := range 5 {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", i), Payload: []byte(`{}`)}))
	}
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	var calls atomic.Int64
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, _ *message.Message) error {
		if topic == "orders" {
			return failure.Permanent(errors.New("message too large"))
		}
		calls.Add(1)
		<-release // a broker that never answers, and a client that does not give up
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{DeadLetterTopic: "orders.dead", Retry: retryOnce, Lease: time.Second})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { _, err := r.RunOnce(ctx); done <- err }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the round still waits for the dead-letter copies after 30s (Lease 1s)")
	}
	require.Equal(t, 5, count(t, b.db, "status = 'failed'"))
	require.EqualValues(t, 1, calls.Load(), "dead-letter calls started after their bound had passed")
}
