package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/millwright/millwright/internal/storage"
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
//
// AddToBatch is the default Writer's (see Add and Writer).
func AddToBatch(ctx context.Context, b *pgx.Batch, events ...Event) error {
	return defaultWriter().AddToBatch(ctx, b, events...)
}

// addToBatch is AddToBatch with w's limits and source.
func (w *Writer) addToBatch(ctx context.Context, b *pgx.Batch, events []Event) error {
	if b == nil {
		return fmt.Errorf("outbox: AddToBatch: nil *pgx.Batch")
	}
	var queued []storage.Statement
	for len(events) > 0 {
		n := min(len(events), maxRowsPerInsert)
		rows := make([]storage.EventRow, n)
		for i, ev := range events[:n] {
			row, err := w.prepare(ctx, ev)
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
