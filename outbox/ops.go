package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// TopicStats is the backlog of one topic, for `millwright outbox status`.
type TopicStats struct {
	Topic            string
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
}

// ReadTopicStats returns the pending and failed counts per topic, reading
// only pending and failed rows (through their partial indexes).
func ReadTopicStats(ctx context.Context, db postgres.Handle) ([]TopicStats, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: ReadTopicStats: %w", err)
	}
	st, err := storage.ReadOutboxTopicStats(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading per-topic stats%s: %w", storage.Hint(err), err)
	}
	out := make([]TopicStats, len(st))
	for i, s := range st {
		out[i] = TopicStats(s)
	}
	return out, nil
}

// FailedFilter selects failed rows for RetryFailed. Empty fields match all.
type FailedFilter struct {
	// Topic limits the retry to one topic.
	Topic string
	// IDs limits the retry to these row ids.
	IDs []int64
}

// FailedEvent describes one failed row.
type FailedEvent struct {
	ID          int64
	EventID     string
	Topic       string
	AggregateID string
	RetryCount  int
	LastError   string
	CreatedAt   time.Time
}

// RetryFailed puts the failed rows matching f back to pending with a fresh
// retry budget, and wakes listening relays; with dryRun it only lists them.
// It returns the rows concerned. Rows go back in id order within their
// aggregate; note that later events of the aggregate may have been
// published meanwhile (see the package documentation). While Debezium
// capture is on (SwitchToDebezium until SwitchToRelay) it refuses, dry run
// included, with an error wrapping ErrCaptureActive that names the fix:
// the connector streams inserts only and would never send the row.
func RetryFailed(ctx context.Context, db postgres.DB, f FailedFilter, dryRun bool) ([]FailedEvent, error) {
	return RetryFailedWithProgress(ctx, db, f, dryRun, nil)
}

// RetryBatch is how many rows RetryFailedWithProgress resets per UPDATE.
const RetryBatch = 1000

// RetryFailedWithProgress is RetryFailed calling progress, if not nil,
// with the rows selected (total) once they are locked and then after each
// UPDATE of at most RetryBatch rows with the rows reset so far. Every batch
// is in the one transaction, committed at the end: a run stopped midway
// changes nothing.
func RetryFailedWithProgress(ctx context.Context, db postgres.DB, f FailedFilter, dryRun bool, progress func(done, total int)) ([]FailedEvent, error) {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: %w", err)
	}
	return retryFailed(ctx, pool, f, dryRun, progress)
}

func retryFailed(ctx context.Context, pool storage.Pool, f FailedFilter, dryRun bool, progress func(done, total int)) ([]FailedEvent, error) {
	if progress == nil {
		progress = func(int, int) {}
	}
	tx, err := pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if dryRun {
		// The change itself checks again (storage.ResetFailedEvents).
		if err := storage.CheckCaptureOff(ctx, tx, "retry-failed"); err != nil {
			return nil, fmt.Errorf("outbox: %w", err)
		}
	}
	var ids []int64
	if len(f.IDs) > 0 {
		ids = f.IDs
	}
	rows, err := storage.ListFailedEvents(ctx, tx, f.Topic, ids, !dryRun)
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: listing failed rows%s: %w", storage.Hint(err), err)
	}
	out := make([]FailedEvent, len(rows))
	sel := make([]int64, len(rows))
	for i, e := range rows {
		out[i] = FailedEvent{ID: e.ID, EventID: e.EventID, Topic: e.Topic, AggregateID: e.AggID, RetryCount: e.RetryCount, LastError: e.LastError, CreatedAt: e.CreatedAt}
		sel[i] = e.ID
	}
	if len(out) == 0 {
		out = nil
	}
	if dryRun || len(sel) == 0 {
		return out, nil
	}
	progress(0, len(sel))
	for start := 0; start < len(sel); start += RetryBatch {
		batch := sel[start:min(start+RetryBatch, len(sel))]
		if _, err := storage.ResetFailedEvents(ctx, tx, batch); err != nil {
			if errors.Is(err, storage.ErrCaptureActive) {
				return nil, fmt.Errorf("outbox: %w", err)
			}
			return nil, fmt.Errorf("outbox: retry-failed: resetting %d row(s) (%d of %d done, none committed): %w", len(batch), start, len(sel), err)
		}
		progress(start+len(batch), len(sel))
	}
	if err := storage.NotifyOutboxRelays(ctx, tx); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: notifying relays: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: commit: %w", err)
	}
	return out, nil
}
