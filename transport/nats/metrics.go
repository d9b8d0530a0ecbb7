package nats

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
)

// The nats kind's metrics (Config.Registerer), per topic and group,
// refreshed every 10 s from the server's stream and consumer info.
const (
	// MetricStreamMessages is the messages the topic's stream holds.
	MetricStreamMessages = "millwright_nats_stream_messages"
	// MetricConsumerPending is the consumer group's lag: messages of the
	// stream not yet delivered to it.
	MetricConsumerPending = "millwright_nats_consumer_pending"
	// MetricConsumerAckPending is the group's messages delivered and not
	// yet acknowledged.
	MetricConsumerAckPending = "millwright_nats_consumer_ack_pending"
	// MetricConsumerRedelivered is the group's messages delivered more
	// than once and not yet acknowledged.
	MetricConsumerRedelivered = "millwright_nats_consumer_redelivered"
)

// metricsInterval is how often the gauges are read from the server.
var metricsInterval = 10 * time.Second

type metrics struct {
	t                                   *Transport
	stream, pending, ackPend, redeliver *prometheus.GaugeVec
	mu                                  sync.Mutex
	watched                             map[[2]string]bool
	stop                                chan struct{}
	done                                chan struct{}
	// kick asks the loop for a refresh now: a group just watched has its
	// series at once, not a metricsInterval later.
	kick chan struct{}
	once sync.Once
}

func newMetrics(t *Transport) *metrics {
	m := &metrics{t: t, watched: map[[2]string]bool{}, stop: make(chan struct{}), done: make(chan struct{}), kick: make(chan struct{}, 1)}
	if t.cfg.Registerer == nil {
		close(m.done)
		return m
	}
	gv := func(name, help string, labels ...string) *prometheus.GaugeVec {
		g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
		r, err := promreg.Register(t.cfg.Registerer, g)
		if err != nil {
			t.logger.Error("NATS metric not registered", err, nil)
			return g
		}
		return r
	}
	m.stream = gv(MetricStreamMessages, "Messages the topic's JetStream stream holds.", "topic")
	m.pending = gv(MetricConsumerPending, "Messages of the topic's stream not yet delivered to the consumer group (its lag).", "topic", "group")
	m.ackPend = gv(MetricConsumerAckPending, "Messages delivered to the consumer group and not yet acknowledged.", "topic", "group")
	m.redeliver = gv(MetricConsumerRedelivered, "Messages delivered to the consumer group more than once and not yet acknowledged.", "topic", "group")
	go m.loop()
	return m
}

func (m *metrics) watch(topic, group string) {
	m.mu.Lock()
	k := [2]string{topic, group}
	added := !m.watched[k]
	m.watched[k] = true
	m.mu.Unlock()
	if added {
		select {
		case m.kick <- struct{}{}:
		default:
		}
	}
}

func (m *metrics) loop() {
	defer close(m.done)
	tick := time.NewTicker(metricsInterval)
	defer tick.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-tick.C:
			m.refresh()
		case <-m.kick:
			m.refresh()
		}
	}
}

func (m *metrics) refresh() {
	m.mu.Lock()
	var w [][2]string
	for k := range m.watched {
		w = append(w, k)
	}
	m.mu.Unlock()
	for _, k := range w {
		ctx, cancel := context.WithTimeout(context.Background(), m.t.cfg.ConnectTimeout)
		s, err := m.t.js.Stream(ctx, StreamName(k[0]))
		if err == nil {
			if si, err := s.Info(ctx); err == nil {
				m.stream.WithLabelValues(k[0]).Set(float64(si.State.Msgs))
			}
			if c, err := s.Consumer(ctx, ConsumerName(k[1])); err == nil {
				if ci, err := c.Info(ctx); err == nil {
					m.pending.WithLabelValues(k[0], k[1]).Set(float64(ci.NumPending))
					m.ackPend.WithLabelValues(k[0], k[1]).Set(float64(ci.NumAckPending))
					m.redeliver.WithLabelValues(k[0], k[1]).Set(float64(ci.NumRedelivered))
				}
			}
		}
		cancel()
	}
}

func (m *metrics) close() {
	m.once.Do(func() { close(m.stop) })
	<-m.done
}
