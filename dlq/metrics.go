package dlq

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// depthCollector reads the DLQ depth from the store at scrape time.
type depthCollector struct {
	store   *Store
	desc    *prometheus.Desc
	timeout time.Duration
}

// NewDepthCollector returns a Prometheus collector for MetricDepth: the
// dead letters stored and not yet replayed, by original topic, queried from
// the store at each scrape (with a 5 s timeout; a failed query is reported
// to the scraper as an invalid metric, not as zero). Register it once per
// process: `reg.MustRegister(dlq.NewDepthCollector(store))`.
func NewDepthCollector(store *Store) prometheus.Collector {
	return &depthCollector{
		store:   store,
		timeout: 5 * time.Second,
		desc: prometheus.NewDesc(MetricDepth,
			"Dead letters stored in millwright_dead_letters and not yet replayed, by original topic.",
			[]string{"topic"}, nil),
	}
}

func (c *depthCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *depthCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	depth, err := c.store.Depth(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	for topic, n := range depth {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), topic)
	}
}
