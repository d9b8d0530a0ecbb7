package storage

import (
	"context"
	"errors"
)

// Queue is a Querier that holds the statements it is given and sends them
// with Flush, in one Batch, after the statements of the same transaction
// that must come first. A saga's transition writes its instance, its
// history and its commands' outbox events (through outbox.Add) into one
// Queue and sends them in one round trip.
//
// Exec and Batch queue and report no row count (0); Query and QueryRow
// are refused. A Queue is not safe for concurrent use.
type Queue struct {
	q  Querier
	ss []Statement
}

// NewQueue returns an empty Queue that Flush sends on q.
func NewQueue(q Querier) *Queue { return &Queue{q: q} }

// ErrQueued is returned by a Queue's Query and QueryRow.
var ErrQueued = errors.New("storage: a Queue holds statements until Flush: it cannot read rows")

func (q *Queue) Driver() Driver { return q.q.Driver() }

func (q *Queue) Exec(_ context.Context, s Statement) (int64, error) {
	q.ss = append(q.ss, s)
	return 0, nil
}

func (q *Queue) Query(context.Context, Statement, func(Row) error) error { return ErrQueued }

func (q *Queue) QueryRow(context.Context, Statement, ...any) error { return ErrQueued }

func (q *Queue) Batch(_ context.Context, ss ...Statement) error {
	q.ss = append(q.ss, ss...)
	return nil
}

// Len returns the number of statements queued.
func (q *Queue) Len() int { return len(q.ss) }

// Statements returns the statements queued, in order.
func (q *Queue) Statements() []Statement { return q.ss }

// Flush sends the queued statements, then more, in one Batch, and empties
// the queue.
func (q *Queue) Flush(ctx context.Context, more ...Statement) error {
	ss := append(q.ss, more...)
	q.ss = nil
	return q.q.Batch(ctx, ss...)
}
