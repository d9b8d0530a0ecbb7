package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/tracing"
)

// AddToBatch queues the INSERT of events into b, a pgx.Batch the caller
// sends in its transaction (tx.SendBatch): the events then travel with the
// business statements queued beside them, in the same round trip, and cost
// the transaction no round trip of its own. They are published if and
// only if that transaction commits.
//
// Add's own checks (ErrInvalidEvent) are made now and returned by
// AddToBatch, which then queues nothing; the server's answer to the INSERT
// (say, a schema without the outbox table) is the batch's, returned by its
// results (BatchResults.Exec or Close) at the position AddToBatch queued
// it, as for any statement of a pgx.Batch. Events are queued 1,000 per
// INSERT, like Add.
func AddToBatch(ctx context.Context, b *pgx.Batch, events ...Event) (err error) {
	ctx, span := tracing.StartWriteSpan(ctx, len(events))
	defer func() { tracing.EndSpan(span, err) }()
	if b == nil {
		return fmt.Errorf("outbox: AddToBatch: nil *pgx.Batch")
	}
	var queued []storage.Statement
	for len(events) > 0 {
		n := min(len(events), maxRowsPerInsert)
		rows := make([]storage.EventRow, n)
		for i, ev := range events[:n] {
			row, err := prepare(ctx, ev)
			if err != nil {
				return fmt.Errorf("outbox: event %d (topic %q): %w", i, ev.Topic, err)
			}
			rows[i] = row
		}
		queued = append(queued, storage.InsertEventsStatement(rows))
		events = events[n:]
	}
	for _, s := range queued {
		b.Queue(s.SQL, s.Args...)
	}
	return nil
}
