package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// MetricLoopPanics is a counter, with a "component" label (outbox.Relay,
// outbox.Cleaner, outbox.CaptureTracker, ...): panics a long-running loop
// recovered from instead of dying. The relay fails the row whose broker
// call panicked (a failure.Permanent error naming the panic, for
// `millwright outbox retry-failed`) and goes on; a cleaner retries at its
// next interval. The log line names the row and has the stack. The saga
// orchestrator counts into the same series (saga.MetricLoopPanics). The
// relay's own metrics are package relay's (relay.MetricPendingCount, ...).
const MetricLoopPanics = "millwright_loop_panics_total"

// Stats summarises the outbox backlog.
type Stats struct {
	// Pending rows wait to be published (including those in backoff).
	Pending int64
	// OldestPendingAge is the age of the oldest pending row, 0 when none.
	OldestPendingAge time.Duration
	// Failed rows exhausted their attempts and wait for an operator.
	Failed int64
}

// ReadStats reads the backlog figures with queries that use only the
// partial indexes on pending and failed rows, so they stay cheap however
// many published rows the table holds: the oldest pending row is the
// oldest of the lanes' heads (one probe of the lane index per lane).
func ReadStats(ctx context.Context, db postgres.Handle) (Stats, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: ReadStats: %w", err)
	}
	return readStats(ctx, q)
}

func readStats(ctx context.Context, q storage.Querier) (Stats, error) {
	s, err := storage.ReadOutboxStats(ctx, q)
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: reading stats from millwright_outbox: %w", err)
	}
	return Stats(s), nil
}
