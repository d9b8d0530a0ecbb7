package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Metric names. The gauges are what an operator looks at first: a growing
// pending count or oldest age means the relays do not keep up, a non-zero
// failed count means events wait for `millwright outbox retry-failed`.
// Like every millwright metric they start with millwright_ (docs/metrics.md,
// Naming, has the rule and the names they had before).
const (
	// MetricPendingCount is a gauge: rows waiting to be published.
	MetricPendingCount = "millwright_outbox_pending_events"
	// MetricOldestPendingAge is a gauge: age in seconds of the oldest
	// pending row, 0 when none.
	MetricOldestPendingAge = "millwright_outbox_oldest_pending_age_seconds"
	// MetricFailedCount is a gauge: rows in the failed state.
	MetricFailedCount = "millwright_outbox_failed_events"
	// MetricPublishLatency is a histogram: duration in seconds of each
	// broker publish call of the relay (one message, or one batch when the
	// publisher is a transport.BatchPublisher).
	MetricPublishLatency = "millwright_outbox_publish_latency_seconds"
	// MetricPublished is a counter: events the relay published and marked.
	MetricPublished = "millwright_outbox_published_total"
	// MetricPublishErrors is a counter: failed publish attempts, each
	// followed by a backoff.
	MetricPublishErrors = "millwright_outbox_publish_errors_total"
	// MetricFailed is a counter: events moved to the failed state after
	// their last attempt.
	MetricFailed = "millwright_outbox_failed_total"
	// MetricLoopPanics is a counter, with a "component" label
	// (outbox.Relay, outbox.Cleaner, ...): panics a long-running loop
	// recovered from instead of dying. The relay fails the row whose
	// broker call panicked (a retry.Permanent error naming the panic, for
	// `millwright outbox retry-failed`) and goes on; a cleaner retries at
	// its next interval. The log line names the row and has the stack.
	// The saga orchestrator counts into the same series
	// (saga.MetricLoopPanics).
	MetricLoopPanics = "millwright_loop_panics_total"
)

// metrics holds the relay's collectors. With a nil Registerer they are
// created but not registered, so the code paths stay the same.
type metrics struct {
	pending       prometheus.Gauge
	oldest        prometheus.Gauge
	failedGauge   prometheus.Gauge
	latency       prometheus.Histogram
	published     prometheus.Counter
	publishErrors prometheus.Counter
	failed        prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		pending:       prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricPendingCount, Help: "Outbox rows waiting to be published."}),
		oldest:        prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricOldestPendingAge, Help: "Age in seconds of the oldest pending outbox row (0 when none)."}),
		failedGauge:   prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricFailedCount, Help: "Outbox rows in the failed state, waiting for an operator."}),
		latency:       prometheus.NewHistogram(prometheus.HistogramOpts{Name: MetricPublishLatency, Help: "Duration of the relay's broker publish calls.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		published:     prometheus.NewCounter(prometheus.CounterOpts{Name: MetricPublished, Help: "Outbox events published and marked by the relay."}),
		publishErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricPublishErrors, Help: "Failed outbox publish attempts."}),
		failed:        prometheus.NewCounter(prometheus.CounterOpts{Name: MetricFailed, Help: "Outbox events moved to the failed state."}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	m.pending = promreg.Into(reg, m.pending, &err)
	m.oldest = promreg.Into(reg, m.oldest, &err)
	m.failedGauge = promreg.Into(reg, m.failedGauge, &err)
	m.latency = promreg.Into(reg, m.latency, &err)
	m.published = promreg.Into(reg, m.published, &err)
	m.publishErrors = promreg.Into(reg, m.publishErrors, &err)
	m.failed = promreg.Into(reg, m.failed, &err)
	return m, err
}

// refreshGauges sets the backlog gauges from Stats.
func (m *metrics) refreshGauges(ctx context.Context, db storage.Querier) error {
	s, err := readStats(ctx, db)
	if err != nil {
		return err
	}
	m.pending.Set(float64(s.Pending))
	m.oldest.Set(s.OldestPendingAge.Seconds())
	m.failedGauge.Set(float64(s.Failed))
	return nil
}

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
