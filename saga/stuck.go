package saga

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// MetricStuckNow is a gauge, with a "type" label: sagas in the stuck state
// now, read from the database at each scrape. Unlike MetricStuck (a counter
// of sagas that became stuck), it stays up until `millwright saga resolve`
// moves the saga on, so an alert on it lasts as long as the problem.
const MetricStuckNow = "millwright_saga_stuck_instances"

// stuckQueryTimeout bounds the count a scrape runs. A scrape that cannot
// count logs the error and reports no sample for the type, rather than a
// stale one or an error that would fail the whole scrape (promhttp's
// default), hiding every other metric of the process while the database is
// away.
const stuckQueryTimeout = 5 * time.Second

// stuckCollector reports MetricStuckNow for one saga type. Orchestrators of
// the same type sharing a Registerer share one collector (promreg).
type stuckCollector struct {
	db     storage.Pool
	typ    string
	desc   *prometheus.Desc
	logger watermill.LoggerAdapter
}

var _ prometheus.Collector = (*stuckCollector)(nil)

func newStuckCollector(db storage.Pool, typ string, logger watermill.LoggerAdapter) *stuckCollector {
	return &stuckCollector{db: db, typ: typ, logger: logger, desc: prometheus.NewDesc(MetricStuckNow,
		"Sagas in the stuck state now (compensation retries exhausted, waiting for `millwright saga resolve`).",
		nil, prometheus.Labels{"type": typ})}
}

func (c *stuckCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *stuckCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), stuckQueryTimeout)
	defer cancel()
	n, err := countStuck(ctx, c.db, c.typ)
	if err != nil {
		c.logger.Error("saga: "+MetricStuckNow+" not reported", err, watermill.LogFields{"saga_type": c.typ})
		return
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n))
}

// CountStuck returns how many sagas of type typ are stuck now. It reads the
// (type, state) index, so it stays cheap however many finished sagas the
// table holds.
func CountStuck(ctx context.Context, db postgres.Handle, typ string) (int64, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return 0, fmt.Errorf("saga %s: counting stuck sagas: %w", typ, err)
	}
	return countStuck(ctx, q, typ)
}

func countStuck(ctx context.Context, q storage.Querier, typ string) (int64, error) {
	n, err := storage.CountSagas(ctx, q, typ, string(StateStuck))
	if err != nil {
		return 0, fmt.Errorf("saga %s: counting stuck sagas%s: %w", typ, storage.Hint(err), err)
	}
	return n, nil
}

// registerStuck registers the stuck gauge of typ with reg (nil: none).
func registerStuck(reg prometheus.Registerer, db storage.Pool, typ string, logger watermill.LoggerAdapter) error {
	if reg == nil {
		return nil
	}
	if _, err := promreg.Register[prometheus.Collector](reg, newStuckCollector(db, typ, logger)); err != nil {
		return fmt.Errorf("saga: registering %s: %w", MetricStuckNow, err)
	}
	return nil
}

// Stopped reports whether Close was called or Run has returned: the
// orchestrator no longer fires step timeouts nor resends compensations.
// health.Orchestrator uses it with Running.
func (o *Orchestrator[D]) Stopped() bool {
	select {
	case <-o.r.Draining():
		return true
	case <-o.r.Done():
		return true
	default:
		return false
	}
}
