package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// PollInterval is how often WaitDrained reads the outbox.
const PollInterval = 10 * time.Millisecond

// ErrFailedEvents is returned (wrapped) by WaitDrained when rows are in the
// failed state: they will never drain on their own.
var ErrFailedEvents = errors.New("outboxtest: outbox has failed events")

// WaitDrained waits until the outbox in db's search_path has no pending
// row,
// that is until every committed event has been published (or has failed).
// It returns ctx's error, naming the backlog, if ctx ends first (give ctx a
// deadline), and ErrFailedEvents if drained but some rows failed.
func WaitDrained(ctx context.Context, db postgres.DB) error {
	t := time.NewTicker(PollInterval)
	defer t.Stop()
	var last outbox.Stats
	for {
		s, err := outbox.ReadStats(ctx, db)
		if err != nil {
			if ctx.Err() != nil {
				return notDrained(ctx, last)
			}
			return err
		}
		last = s
		if s.Pending == 0 {
			if s.Failed > 0 {
				return fmt.Errorf("%w: %d row(s) failed; see last_error in millwright_outbox or run `millwright outbox status`", ErrFailedEvents, s.Failed)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return notDrained(ctx, s)
		case <-t.C:
		}
	}
}

func notDrained(ctx context.Context, s outbox.Stats) error {
	return fmt.Errorf("outboxtest: outbox not drained, %d pending, oldest %s old (is a relay running?): %w",
		s.Pending, s.OldestPendingAge.Round(time.Millisecond), ctx.Err())
}
