package idempotencytest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/metadata"
)

// NewMessage returns a message with a fresh UUID whose metadata.EventID is
// eventID, as the outbox publishes it. Each call makes a new delivery of the
// same event when eventID repeats.
func NewMessage(eventID string, payload []byte) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), payload)
	msg.Metadata.Set(metadata.EventID, eventID)
	return msg
}

// Exercise runs the shared Store suite. newStore returns an empty store for
// one subtest; it is called once per subtest, which may run in parallel.
func Exercise(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Helper()

	t.Run("CommittedMarkIsADuplicate", func(t *testing.T) { exerciseCommittedMarkIsADuplicate(t, newStore) })

	t.Run("RollbackRemovesMark", func(t *testing.T) { exerciseRollbackRemovesMark(t, newStore) })

	t.Run("ScopedByConsumer", func(t *testing.T) { exerciseScopedByConsumer(t, newStore) })

	t.Run("IDsAreOpaqueStrings", func(t *testing.T) { exerciseIDsAreOpaqueStrings(t, newStore) })

	// The second unit of work may reach Mark before or after the first
	// commits; either way it must return false. A store that let it through
	// while the first was pending would fail whenever it ran first.
	t.Run("ConcurrentMarkWaitsThenSeesCommit", func(t *testing.T) { exerciseConcurrentMarkWaitsThenSeesCommit(t, newStore) })

	t.Run("ConcurrentMarkWaitsThenTakesOverAfterRollback", func(t *testing.T) { exerciseConcurrentMarkWaitsThenTakesOverAfterRollback(t, newStore) })

	t.Run("MarkerWritesOneCommittedMark", func(t *testing.T) { exerciseMarkerWritesOneCommittedMark(t, newStore) })

	t.Run("BeginMarkIsBeginThenMark", func(t *testing.T) { exerciseBeginMarkIsBeginThenMark(t, newStore) })

	t.Run("WaitingMarkStopsWithContext", func(t *testing.T) { exerciseWaitingMarkStopsWithContext(t, newStore) })
}

func exerciseCommittedMarkIsADuplicate(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	seen, err := s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, seen, "fresh store has no marks")

	tx := begin(t, s)
	fresh, err := tx.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh, "first mark is fresh")
	again, err := tx.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, again, "second mark in the same unit of work is not fresh")

	seen, err = s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, seen, "uncommitted mark is invisible to Processed")
	require.NoError(t, tx.Commit())

	seen, err = s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, seen, "committed mark is visible")

	tx2 := begin(t, s)
	fresh, err = tx2.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, fresh, "mark committed earlier makes a duplicate")
	require.NoError(t, tx2.Rollback())
}

func exerciseRollbackRemovesMark(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	tx := begin(t, s)
	fresh, err := tx.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)
	require.NoError(t, tx.Rollback())
	require.NoError(t, tx.Rollback(), "second Rollback is harmless")

	seen, err := s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, seen, "rolled back mark is gone")

	tx2 := begin(t, s)
	fresh, err = tx2.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh, "after rollback the event can be marked again")
	require.NoError(t, tx2.Commit())
}

func exerciseScopedByConsumer(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	for _, consumer := range []string{"billing", "shipping"} {
		tx := begin(t, s)
		fresh, err := tx.Mark(ctx, consumer, "e1")
		require.NoError(t, err)
		require.True(t, fresh, "consumer %s marks e1 once", consumer)
		require.NoError(t, tx.Commit())
	}
	seen, err := s.Processed(ctx, "inventory", "e1")
	require.NoError(t, err)
	require.False(t, seen, "a third consumer has not processed e1")
	seen, err = s.Processed(ctx, "billing", "e2")
	require.NoError(t, err)
	require.False(t, seen, "another event is not marked")
}

func exerciseIDsAreOpaqueStrings(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)
	ids := []string{`it's`, `back\slash`, `'); DROP TABLE millwright_processed_events; --`, "$1", "ünïcødé-✓", strings.Repeat("x", 2000)}
	for _, id := range ids {
		tx := begin(t, s)
		fresh, err := tx.Mark(ctx, "c'"+id, id)
		require.NoError(t, err, "id %q", id)
		require.True(t, fresh, "id %q", id)
		require.NoError(t, tx.Commit())
	}
	for _, id := range ids {
		seen, err := s.Processed(ctx, "c'"+id, id)
		require.NoError(t, err)
		require.True(t, seen, "id %q round-trips", id)
		seen, err = s.Processed(ctx, "c'"+id, id+"x")
		require.NoError(t, err)
		require.False(t, seen, "a different id %q is not marked", id+"x")
	}
}

func exerciseConcurrentMarkWaitsThenSeesCommit(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	first := begin(t, s)
	fresh, err := first.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)

	result := markAsync(ctx, t, s, "c", "e1")
	require.NoError(t, first.Commit())
	r := await(t, result)
	require.NoError(t, r.err)
	require.False(t, r.fresh, "second unit of work sees the committed mark")
}

func exerciseConcurrentMarkWaitsThenTakesOverAfterRollback(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	first := begin(t, s)
	fresh, err := first.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)

	result := markAsync(ctx, t, s, "c", "e1")
	require.NoError(t, first.Rollback())
	r := await(t, result)
	require.NoError(t, r.err)
	require.True(t, r.fresh, "after the first rolled back, the second writes the mark")
}

func exerciseMarkerWritesOneCommittedMark(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)
	mk, ok := s.(idempotency.Marker)
	if !ok {
		t.Skip("store does not implement idempotency.Marker")
	}
	fresh, err := mk.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)
	seen, err := s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, seen, "Marker.Mark commits")
	fresh, err = mk.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, fresh)

	// It waits for a unit of work holding the same mark.
	first := begin(t, s)
	fresh, err = first.Mark(ctx, "c", "e2")
	require.NoError(t, err)
	require.True(t, fresh)
	result := make(chan markResult, 1)
	go func() {
		fresh, err := mk.Mark(ctx, "c", "e2")
		result <- markResult{fresh, err}
	}()
	require.NoError(t, first.Commit())
	r := await(t, result)
	require.NoError(t, r.err)
	require.False(t, r.fresh)
}

func exerciseBeginMarkIsBeginThenMark(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)
	bm, ok := s.(idempotency.BeginMarker)
	if !ok {
		t.Skip("store does not implement idempotency.BeginMarker")
	}
	tx, fresh, err := bm.BeginMark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh, "first mark is fresh")
	seen, err := s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, seen, "uncommitted mark is invisible to Processed")
	require.NoError(t, tx.Commit())
	seen, err = s.Processed(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, seen, "committed mark is visible")

	tx, fresh, err = bm.BeginMark(ctx, "c", "e1")
	require.NoError(t, err)
	require.False(t, fresh, "mark committed earlier makes a duplicate")
	require.NoError(t, tx.Rollback())

	tx, fresh, err = bm.BeginMark(ctx, "c", "e2")
	require.NoError(t, err)
	require.True(t, fresh)
	require.NoError(t, tx.Rollback())
	seen, err = s.Processed(ctx, "c", "e2")
	require.NoError(t, err)
	require.False(t, seen, "rolled back mark is gone")

	// A second BeginMark of a mark held uncommitted waits, then sees
	// the commit; after a rollback it takes over.
	for _, commit := range []bool{true, false} {
		id := fmt.Sprintf("held-%t", commit)
		first, fresh, err := bm.BeginMark(ctx, "c", id)
		require.NoError(t, err)
		require.True(t, fresh)
		result := make(chan markResult, 1)
		go func() {
			tx, fresh, err := bm.BeginMark(ctx, "c", id)
			if err == nil {
				_ = tx.Rollback()
			}
			result <- markResult{fresh, err}
		}()
		if commit {
			require.NoError(t, first.Commit())
		} else {
			require.NoError(t, first.Rollback())
		}
		r := await(t, result)
		require.NoError(t, r.err)
		require.Equal(t, !commit, r.fresh, "second BeginMark after the first's commit=%t", commit)
	}

	// One waiting on an uncommitted mark returns when its context
	// ends, and leaves nothing open: the store goes on working.
	first, _, err := bm.BeginMark(ctx, "c", "e3")
	require.NoError(t, err)
	waitCtx, cancel := context.WithCancel(ctx)
	result := make(chan markResult, 1)
	go func() {
		tx, fresh, err := bm.BeginMark(waitCtx, "c", "e3")
		if err == nil {
			_ = tx.Rollback()
		}
		result <- markResult{fresh, err}
	}()
	cancel()
	r := await(t, result)
	require.Error(t, r.err, "a BeginMark waiting on an uncommitted mark returns when its context is cancelled")
	require.NoError(t, first.Commit())
	tx, fresh, err = bm.BeginMark(ctx, "c", "e4")
	require.NoError(t, err)
	require.True(t, fresh)
	require.NoError(t, tx.Commit())
}

func exerciseWaitingMarkStopsWithContext(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Parallel()
	ctx := context.Background()
	s := newStore(t)

	first := begin(t, s)
	fresh, err := first.Mark(ctx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)

	waitCtx, cancel := context.WithCancel(ctx)
	result := markAsync(waitCtx, t, s, "c", "e1")
	cancel()
	r := await(t, result)
	require.Error(t, r.err, "a Mark waiting on an uncommitted mark returns when its context is cancelled")
	require.NoError(t, first.Commit())
}

// awaitTimeout bounds every wait of the suite for a Mark that should end:
// a store that never returns fails the subtest instead of hanging until
// the test binary's timeout.
const awaitTimeout = 30 * time.Second

// await returns the result of a Mark started on another goroutine.
func await(t *testing.T, result <-chan markResult) markResult {
	t.Helper()
	select {
	case r := <-result:
		return r
	case <-time.After(awaitTimeout):
		t.Fatalf("idempotencytest: a Mark waiting on another unit of work's mark did not return within %s after that unit ended (or its context was cancelled)", awaitTimeout)
		return markResult{}
	}
}

type markResult struct {
	fresh bool
	err   error
}

// markAsync marks in a new unit of work on another goroutine, rolls it back
// and sends the result.
func markAsync(ctx context.Context, t *testing.T, s idempotency.Store, consumer, eventID string) <-chan markResult {
	t.Helper()
	out := make(chan markResult, 1)
	tx, err := s.Begin(context.Background())
	require.NoError(t, err)
	go func() {
		fresh, err := tx.Mark(ctx, consumer, eventID)
		_ = tx.Rollback()
		out <- markResult{fresh, err}
	}()
	return out
}

func begin(t *testing.T, s idempotency.Store) idempotency.Tx {
	t.Helper()
	tx, err := s.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}
