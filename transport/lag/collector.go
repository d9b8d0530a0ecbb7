package lag

import (
	"context"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names (docs/metrics.md). Labels: transport, group, topic (the
// queue on RabbitMQ, the subscription on Pub/Sub), partition ("" where
// there is none).
const (
	// MetricMessages is Partition.Lag: the messages a consumer group has
	// not consumed yet.
	MetricMessages = "millwright_consumer_lag_messages"
	// MetricUnacked is Partition.Unacked, where the broker says.
	MetricUnacked = "millwright_consumer_unacked_messages"
	// MetricKeysInFlight is Partition.KeysInFlight of the key-parallel
	// consumers' partitions.
	MetricKeysInFlight = "millwright_consumer_keys_in_flight"
	// MetricKeyedWaiting is Partition.Waiting of the key-parallel
	// consumers' partitions.
	MetricKeyedWaiting = "millwright_consumer_keyed_waiting_messages"
	// MetricErrors counts the scrapes whose reading of the lag failed
	// (no label: one reader's failure fails the scrape's reading).
	MetricErrors = "millwright_consumer_lag_errors_total"
)

var labels = []string{"transport", "group", "topic", "partition"}

var (
	descMessages = prometheus.NewDesc(MetricMessages, "Messages a consumer group has not consumed yet: the partition's high-water mark minus the group's committed offset (Kafka), the messages ready in the queue (RabbitMQ).", labels, nil)
	descUnacked  = prometheus.NewDesc(MetricUnacked, "Messages delivered to a consumer and not acknowledged yet (RabbitMQ with its management API, Pub/Sub: this process's outstanding).", labels, nil)
	descKeys     = prometheus.NewDesc(MetricKeysInFlight, "Keys with messages being handled or queued in a partition a key-parallel consumer of this process holds.", labels, nil)
	descWaiting  = prometheus.NewDesc(MetricKeyedWaiting, "Messages queued behind their key's running message in a partition a key-parallel consumer of this process holds.", labels, nil)
)

// CollectorConfig configures a Collector.
type CollectorConfig struct {
	// Timeout bounds each scrape's reading. Default 10s; must be >= 0.
	Timeout time.Duration
}

// Collector is a prometheus.Collector that reads the lag at scrape time.
type Collector struct {
	r       Reader
	timeout time.Duration
	errors  prometheus.Counter
}

// NewCollector returns a collector of r's lag.
func NewCollector(r Reader, cfg CollectorConfig) *Collector {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	return &Collector{r: r, timeout: cfg.Timeout, errors: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricErrors, Help: "Scrapes whose reading of consumer lag failed (the broker could not be asked); the lag series are left out of that scrape."})}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descMessages
	ch <- descUnacked
	ch <- descKeys
	ch <- descWaiting
	c.errors.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	ps, err := c.r.Lag(ctx)
	if err != nil {
		c.errors.Inc()
	}
	ch <- c.errors
	for _, p := range ps {
		part := ""
		if p.Partition != NoPartition {
			part = strconv.Itoa(int(p.Partition))
		}
		lv := []string{p.Transport, p.Group, p.Topic, part}
		gauge(ch, descMessages, float64(p.Lag), lv)
		if p.Unacked >= 0 {
			gauge(ch, descUnacked, float64(p.Unacked), lv)
		}
		if p.Keyed {
			gauge(ch, descKeys, float64(p.KeysInFlight), lv)
			gauge(ch, descWaiting, float64(p.Waiting), lv)
		}
	}
}

// gauge sends one sample, or an invalid metric (which the registry
// reports as the scrape's error) for label values Prometheus refuses.
func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, lv []string) {
	m, err := prometheus.NewConstMetric(d, prometheus.GaugeValue, v, lv...)
	if err != nil {
		m = prometheus.NewInvalidMetric(d, err)
	}
	ch <- m
}
