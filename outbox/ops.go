package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/lib/pq"
)

func int64Array(ids []int64) any { return pq.Array(ids) }

// TopicStats is the backlog of one topic, for `millwright outbox status`.
type TopicStats struct {
	Topic            string
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
}

// ReadTopicStats returns the pending and failed counts per topic, reading
// only pending and failed rows (through their partial indexes).
func ReadTopicStats(ctx context.Context, db sqlExecutor) ([]TopicStats, error) {
	rows, err := db.QueryContext(ctx, `SELECT topic,
		count(*) FILTER (WHERE status = 'pending'),
		COALESCE(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8, 0),
		count(*) FILTER (WHERE status = 'failed')
	FROM (
		SELECT topic, status, created_at FROM millwright_outbox WHERE status = 'pending'
		UNION ALL
		SELECT topic, status, created_at FROM millwright_outbox WHERE status = 'failed'
	) b GROUP BY topic ORDER BY topic`)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading per-topic stats (did `millwright migrate` run?): %w", err)
	}
	defer rows.Close()
	var out []TopicStats
	for rows.Next() {
		var s TopicStats
		var age float64
		if err := rows.Scan(&s.Topic, &s.Pending, &age, &s.Failed); err != nil {
			return nil, fmt.Errorf("outbox: reading per-topic stats: %w", err)
		}
		s.OldestPendingAge = time.Duration(max(age, 0) * float64(time.Second))
		out = append(out, s)
	}
	return out, rows.Err()
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
// published meanwhile (see the package documentation).
func RetryFailed(ctx context.Context, db *sql.DB, f FailedFilter, dryRun bool) ([]FailedEvent, error) {
	return RetryFailedWithProgress(ctx, db, f, dryRun, nil)
}

// RetryBatch is how many rows RetryFailedWithProgress resets per UPDATE.
const RetryBatch = 1000

// RetryFailedWithProgress is RetryFailed calling progress, if not nil,
// with the rows selected (total) once they are locked and then after each
// UPDATE of at most RetryBatch rows with the rows reset so far. Every batch
// is in the one transaction, committed at the end: a run stopped midway
// changes nothing.
func RetryFailedWithProgress(ctx context.Context, db *sql.DB, f FailedFilter, dryRun bool, progress func(done, total int)) ([]FailedEvent, error) {
	if progress == nil {
		progress = func(int, int) {}
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	var ids any
	if len(f.IDs) > 0 {
		ids = int64Array(f.IDs)
	}
	lock := " FOR UPDATE"
	if dryRun {
		lock = ""
	}
	rows, err := tx.QueryContext(ctx, `SELECT id, event_id, topic, aggregate_id, retry_count, COALESCE(last_error, ''), created_at
		FROM millwright_outbox
		WHERE status = 'failed' AND ($1 = '' OR topic = $1) AND ($2::bigint[] IS NULL OR id = ANY($2))
		ORDER BY id`+lock, f.Topic, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: listing failed rows (did `millwright migrate` run?): %w", err)
	}
	var out []FailedEvent
	var sel []int64
	for rows.Next() {
		var e FailedEvent
		if err := rows.Scan(&e.ID, &e.EventID, &e.Topic, &e.AggregateID, &e.RetryCount, &e.LastError, &e.CreatedAt); err != nil {
			rows.Close()
			return nil, fmt.Errorf("outbox: retry-failed: %w", err)
		}
		out = append(out, e)
		sel = append(sel, e.ID)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: %w", err)
	}
	if dryRun || len(sel) == 0 {
		return out, nil
	}
	progress(0, len(sel))
	for start := 0; start < len(sel); start += RetryBatch {
		batch := sel[start:min(start+RetryBatch, len(sel))]
		if _, err := tx.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'pending', retry_count = 0, next_attempt_at = now()
			WHERE id = ANY($1) AND status = 'failed'`, int64Array(batch)); err != nil {
			return nil, fmt.Errorf("outbox: retry-failed: resetting %d row(s) (%d of %d done, none committed): %w", len(batch), start, len(sel), err)
		}
		progress(start+len(batch), len(sel))
	}
	if _, err := tx.ExecContext(ctx, `SELECT pg_notify(`+notifyChannelSQL("n.nspname::text")+`, '')
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'millwright_outbox'::regclass`); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: notifying relays: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: commit: %w", err)
	}
	return out, nil
}
