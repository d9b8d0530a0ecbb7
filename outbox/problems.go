package outbox

import (
	"context"
	"fmt"
	"time"
)

// ProblemEvent is a row the relay has failed to publish: failed for good,
// or pending after failed attempts (backing off, holding back its
// aggregate). `millwright outbox status` lists them with their last error,
// which is otherwise only in the table and the publish-error counter.
type ProblemEvent struct {
	ID          int64
	EventID     string
	Topic       string
	AggregateID string
	// Failed is true for a failed row, false for a pending row that has
	// failed RetryCount attempts.
	Failed     bool
	RetryCount int
	// LastError is the last attempt's error, cut to MaxProblemErrorChars characters.
	LastError string
	CreatedAt time.Time
	// NextAttemptAt is when a retrying row is tried again.
	NextAttemptAt time.Time
}

// MaxProblemErrorChars bounds ProblemEvent.LastError, in characters.
const MaxProblemErrorChars = 500

// ReadProblems returns at most limit failed rows, the most recent first,
// then at most limit retrying rows, those with the most failed attempts
// first. It reads only failed rows and pending rows with failed attempts,
// through their partial indexes. limit must be positive.
func ReadProblems(ctx context.Context, db sqlExecutor, limit int) ([]ProblemEvent, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("outbox: ReadProblems: limit %d: want at least 1", limit)
	}
	rows, err := db.QueryContext(ctx, `(SELECT id, event_id, topic, aggregate_id, true, retry_count, left(coalesce(last_error, ''), $2), created_at, next_attempt_at
		FROM millwright_outbox WHERE status = 'failed' ORDER BY id DESC LIMIT $1)
	UNION ALL
	(SELECT id, event_id, topic, aggregate_id, false, retry_count, left(coalesce(last_error, ''), $2), created_at, next_attempt_at
		FROM millwright_outbox WHERE status = 'pending' AND retry_count > 0 ORDER BY retry_count DESC, id LIMIT $1)`, limit, MaxProblemErrorChars)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading failed and retrying events (did `millwright migrate` run?): %w", err)
	}
	defer rows.Close()
	var out []ProblemEvent
	for rows.Next() {
		var p ProblemEvent
		if err := rows.Scan(&p.ID, &p.EventID, &p.Topic, &p.AggregateID, &p.Failed, &p.RetryCount, &p.LastError, &p.CreatedAt, &p.NextAttemptAt); err != nil {
			return nil, fmt.Errorf("outbox: reading failed and retrying events: %w", err)
		}
		out = append(out, p)
	}
	return out, rows.Err()
}
