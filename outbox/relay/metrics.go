package relay

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/storage"
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
	s, err := storage.ReadOutboxStats(ctx, db)
	if err != nil {
		return err
	}
	m.pending.Set(float64(s.Pending))
	m.oldest.Set(s.OldestPendingAge.Seconds())
	m.failedGauge.Set(float64(s.Failed))
	return nil
}
