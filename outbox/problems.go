package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
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
func ReadProblems(ctx context.Context, db postgres.Handle, limit int) ([]ProblemEvent, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("outbox: ReadProblems: limit %d: want at least 1", limit)
	}
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: ReadProblems: %w", err)
	}
	return readProblems(ctx, q, limit)
}

func readProblems(ctx context.Context, q storage.Querier, limit int) ([]ProblemEvent, error) {
	ps, err := storage.ReadOutboxProblems(ctx, q, limit, MaxProblemErrorChars)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading failed and retrying events%s: %w", storage.Hint(err), err)
	}
	var out []ProblemEvent
	for _, p := range ps {
		out = append(out, ProblemEvent{ID: p.ID, EventID: p.EventID, Topic: p.Topic, AggregateID: p.AggID, Failed: p.Failed,
			RetryCount: p.RetryCount, LastError: p.LastError, CreatedAt: p.CreatedAt, NextAttemptAt: p.NextAt})
	}
	return out, nil
}
