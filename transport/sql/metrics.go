package sql

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
)

// Metric names. The horizon is server-wide: every transport on one
// Postgres server reports the same values, so aggregate with max().
const (
	// MetricHorizonAge is a gauge: how long, in seconds, the transaction
	// holding the Postgres xmin horizon (the oldest running transaction
	// with an id, in any database of the server) has been open; 0 when
	// none runs. While it is open, sql-transport consumers receive nothing
	// committed after it took its id (see Horizon). Set every
	// Config.HorizonCheckInterval once the transport has a subscriber.
	MetricHorizonAge = "millwright_sql_horizon_oldest_transaction_age_seconds"
	// MetricHorizonPID is a gauge: the backend pid of that transaction, to
	// pass to pg_terminate_backend; 0 when none runs or it is a prepared
	// transaction (the log names its gid). A pid is a value, not a label:
	// a label would start a new series for every holder (pids are many
	// and reused).
	MetricHorizonPID = "millwright_sql_horizon_oldest_transaction_pid"
)

// metrics holds the transport's gauges. With a nil Registerer they are
// created but not registered, so the code paths stay the same.
type metrics struct {
	horizonAge prometheus.Gauge
	horizonPID prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		horizonAge: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricHorizonAge,
			Help: "Seconds the transaction holding the Postgres xmin horizon has been open (0: none); sql-transport consumers receive nothing committed after it started writing."}),
		horizonPID: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricHorizonPID,
			Help: "Backend pid of the transaction holding the Postgres xmin horizon, for pg_terminate_backend (0: none, or a prepared transaction)."}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	m.horizonAge = promreg.Into(reg, m.horizonAge, &err)
	m.horizonPID = promreg.Into(reg, m.horizonPID, &err)
	if err != nil {
		return m, fmt.Errorf("sql: registering metrics: %w", err)
	}
	return m, nil
}
