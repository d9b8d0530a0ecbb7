package googlecloud

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
)

// Metric names, each a gauge labelled with the subscription.
const (
	// MetricOutstanding is how many messages of the subscription this
	// process has delivered to handlers and not yet seen acked or nacked.
	MetricOutstanding = "millwright_googlecloud_outstanding_messages"
	// MetricLastDelivery is the Unix time of the subscription's last
	// delivery to this process (0: none yet). Pub/Sub's API shows no
	// backlog: alert when Cloud Monitoring's
	// subscription/oldest_unacked_message_age exceeds RedeliveryBound
	// while this is older than RedeliveryBound (a killed consumer's
	// messages that were not redelivered).
	MetricLastDelivery = "millwright_googlecloud_last_delivery_timestamp_seconds"
	// MetricStalled is 1 while the subscription has messages outstanding
	// in this process and nothing was delivered, acked or nacked for
	// longer than RedeliveryBound (the transport then logs an error
	// naming the subscription), else 0.
	MetricStalled = "millwright_googlecloud_subscription_stalled"
)

type metrics struct {
	outstanding, lastDelivery, stalled *prometheus.GaugeVec
}

// newMetrics creates the gauges; with a nil Registerer they are not
// registered, so the code paths stay the same.
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	l := []string{"subscription"}
	m := &metrics{
		outstanding: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricOutstanding,
			Help: "Messages of the subscription delivered to handlers in this process and not yet acked or nacked."}, l),
		lastDelivery: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricLastDelivery,
			Help: "Unix time of the subscription's last delivery to this process (0: none yet)."}, l),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricStalled,
			Help: "1 while messages of the subscription are outstanding in this process and nothing was delivered, acked or nacked for longer than the redelivery bound."}, l),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	m.outstanding = promreg.Into(reg, m.outstanding, &err)
	m.lastDelivery = promreg.Into(reg, m.lastDelivery, &err)
	m.stalled = promreg.Into(reg, m.stalled, &err)
	if err != nil {
		return m, fmt.Errorf("googlecloud: registering metrics: %w", err)
	}
	return m, nil
}

// RedeliveryBound is how long after a consumer dies or closes holding
// messages they are redelivered at the latest: MaxExtension (the lease)
// on Pub/Sub; EmulatorStreamDeadline plus two MaxExtension on the emulator,
// which ends a dead consumer's streams only at their deadline and
// redelivers in waves; two MaxExtension on Config.Fake.
func RedeliveryBound(c Config) time.Duration {
	setDefaults(&c)
	switch {
	case c.Fake:
		return 2 * c.MaxExtension
	case emulatorHost(c) != "":
		return EmulatorStreamDeadline + 2*c.MaxExtension
	}
	return c.MaxExtension
}

// stallCheckEvery is how often a subscription is checked for a stall;
// stallBound, if set (by tests), replaces RedeliveryBound as the stall
// threshold.
var stallCheckEvery, stallBound atomic.Int64 // time.Duration; 0: a second, RedeliveryBound

// Subscriber is watermill-googlecloud's subscriber that watches each
// subscription for a stall (see MetricStalled).
type Subscriber struct {
	*wgc.Subscriber
	t       *Transport
	group   string
	closing chan struct{}
	once    sync.Once
}

// Subscribe subscribes to topic, as watermill-googlecloud does.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	w := &watch{
		sub:     SubscriptionName(topic, s.group),
		bound:   RedeliveryBound(s.t.cfg),
		logger:  s.t.logger,
		m:       s.t.metrics,
		last:    time.Now(),
		closing: s.closing,
	}
	if d := time.Duration(stallBound.Load()); d > 0 {
		w.bound = d
	}
	w.m.lastDelivery.WithLabelValues(w.sub).Set(0)
	w.m.outstanding.WithLabelValues(w.sub).Set(0)
	w.m.stalled.WithLabelValues(w.sub).Set(0)
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		stop := make(chan struct{})
		defer close(stop)
		go w.run(stop)
		for m := range in {
			w.delivered(m)
			select {
			case out <- m:
			case <-s.closing: // watermill-googlecloud nacks it
			case <-ctx.Done():
			}
		}
	}()
	return out, nil
}

// Close closes the subscriber; it is idempotent.
func (s *Subscriber) Close() error {
	s.once.Do(func() { close(s.closing) })
	return s.Subscriber.Close()
}

// watch follows one subscription's deliveries in this process.
type watch struct {
	sub     string
	bound   time.Duration
	logger  watermill.LoggerAdapter
	m       *metrics
	closing <-chan struct{}

	mu          sync.Mutex
	outstanding int
	last        time.Time // last delivery, ack or nack
	stalled     bool
}

func (w *watch) delivered(m *message.Message) {
	now := time.Now()
	w.mu.Lock()
	w.outstanding++
	w.last = now
	// Set under the lock: two settles setting out of order would leave
	// the gauge wrong.
	w.m.outstanding.WithLabelValues(w.sub).Set(float64(w.outstanding))
	w.mu.Unlock()
	w.m.lastDelivery.WithLabelValues(w.sub).Set(float64(now.UnixNano()) / 1e9)
	// The context is read here, before the message is handed on: the
	// router and middlewares replace it (SetContext) while it is handled.
	ctx := m.Context()
	go func() {
		select {
		case <-m.Acked():
		case <-m.Nacked():
		case <-w.closing: // watermill-googlecloud nacks it
		case <-ctx.Done(): // and here too
		}
		w.mu.Lock()
		w.outstanding--
		w.last = time.Now()
		w.m.outstanding.WithLabelValues(w.sub).Set(float64(w.outstanding))
		w.mu.Unlock()
	}()
}

func (w *watch) run(stop <-chan struct{}) {
	every := time.Duration(stallCheckEvery.Load())
	if every <= 0 {
		every = time.Second
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			w.m.stalled.WithLabelValues(w.sub).Set(0)
			return
		case now := <-tick.C:
			w.check(now)
		}
	}
}

func (w *watch) check(now time.Time) {
	w.mu.Lock()
	idle, n := now.Sub(w.last), w.outstanding
	stalled := n > 0 && idle > w.bound
	was := w.stalled
	w.stalled = stalled
	w.mu.Unlock()
	switch {
	case stalled && !was:
		w.m.stalled.WithLabelValues(w.sub).Set(1)
		w.logger.Error(fmt.Sprintf("googlecloud: subscription %s is stalled: %d messages delivered to handlers here are neither acked nor nacked, and nothing was delivered, acked or nacked for %s (longer than the redelivery bound %s). A handler that never acks or nacks holds its message and, for ordered delivery, every later message of its ordering key, while the client renews the lease for up to an hour: check this subscription's handlers (a lock, a call without a timeout), or nack to have the message redelivered",
			w.sub, n, idle.Round(time.Second), w.bound), nil, watermill.LogFields{"subscription": w.sub, "outstanding": n})
	case !stalled && was:
		w.m.stalled.WithLabelValues(w.sub).Set(0)
		w.logger.Info("googlecloud: subscription "+w.sub+" is moving again", watermill.LogFields{"subscription": w.sub})
	}
}
