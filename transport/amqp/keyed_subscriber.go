package amqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/internal/keyed"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/metadata"
)

// KeyedSubscriber is millwright's key-parallel RabbitMQ consumer, selected
// by Config.KeyParallelism. watermill-amqp v2.1.3's subscriber sends a
// queue's next delivery only after the previous one's ack (its
// ProcessMessages loop), so a handler that takes 5 ms caps a queue at 200
// msg/s whatever the prefetch, and a nack requeues the message behind its
// key's later ones. KeyedSubscriber consumes each subscribed queue on a
// connection and channel of its own, with the channel's prefetch (QoS) at
// Config.Prefetch, and runs the deliveries through a keyed.Partition:
//
//   - deliveries with one metadata.OrderingKey (the aggregate) are sent to
//     the output channel one at a time, in queue order: the next only
//     after the previous one's ack;
//   - deliveries of different keys are out at the same time, up to
//     KeyParallelism per subscription; Watermill's Router runs each
//     message it reads in its own goroutine, so every middleware
//     (idempotency, retry, dlq, park, tracing) works unchanged;
//   - a delivery is acked to RabbitMQ (per delivery tag) only once the
//     Router acked its message, that is once its handler finished; at
//     most Prefetch deliveries are unacked, which bounds memory;
//   - a nacked message is sent again after 100 ms in its key's place,
//     holding its key (the others go on): never requeued to RabbitMQ,
//     where it would fall behind its key's later messages. Its key's
//     later deliveries wait unacked and count against Prefetch: a key
//     that keeps failing stops the queue once Prefetch deliveries wait
//     (park it with package park instead);
//   - when the connection or channel is lost, RabbitMQ requeues every
//     unacked delivery, in queue order. A key's unacked deliveries are
//     all at or after its first unfinished one (a key's messages finish
//     and are acked in order), so they come back in their order. The
//     subscriber redials (at once, then with backoff from 100 ms to 5 s,
//     each attempt bounded by ConnectTimeout) and consumes again; a
//     handler still running from the lost channel keeps its key, so the
//     key's redelivered messages wait for it, and its ack is lost
//     (RabbitMQ redelivers that message: at least once, deduplicate with
//     package idempotency); deliveries of the lost channel not yet
//     handed out are dropped as soon as it closes, since RabbitMQ
//     redelivers them: they give back their Prefetch slots at once
//     rather than when their key's running handler returns, so one slow
//     handler cannot leave the new channel's deliveries no slot;
//   - the queue is consumed exclusively (basic.consume's exclusive
//     flag), so no other consumer gets its deliveries while this one's
//     are unacked. That is what keeps a key in order across a half-open
//     connection (the client's side reset, RabbitMQ's still open: a
//     dropped NAT or conntrack entry): RabbitMQ holds the old
//     connection's unacked deliveries until its heartbeat timeout closes
//     it (the transport negotiates a 10 s heartbeat; RabbitMQ gives up
//     after about three silent intervals, 30 s measured), and a consumer
//     on a new connection would meanwhile get each key's later messages
//     before them. Until RabbitMQ closes the old connection, consuming
//     is refused (ACCESS_REFUSED, "in exclusive use") and the subscriber
//     retries with the backoff above: the recovery bound is RabbitMQ's
//     heartbeat timeout plus at most 5 s, about 35 s. A second consumer
//     of the queue (another process of the group, or a second Subscribe
//     to the topic) waits the same way as a standby and takes over when
//     the first one's connection ends;
//   - a panic while a delivery is handed out (reading it, for one) is
//     recovered: logged with the delivery's tag, message id, ordering key
//     and stack, counted (Panics), and the delivery is run again after
//     100 ms in its key's place, like a nack; the subscription goes on.
//     (A panic in the Router's handler is the Router's: use Watermill's
//     middleware.Recoverer, which turns it into a nack.)
//   - Close (or the end of Subscribe's ctx) stops consuming, waits up to
//     KeyDrainTimeout for the messages out to be acked or nacked, acks
//     those that were, then closes the channel: RabbitMQ requeues the
//     rest. Handlers still running after the bound have their message's
//     context cancelled.
//
// Per-key order needs one consumer on the queue, which exclusive
// consumption enforces: a queue consumed by watermill-amqp's subscriber
// (KeyParallelism 0) in another process refuses this one, which waits
// until that consumer stops. Messages without an ordering key have no order among
// themselves. The key is read from the delivery's metadata.OrderingKey
// header, which the publisher sends with every message that has one.
type KeyedSubscriber struct {
	t      *Transport
	group  string
	wcfg   wamqp.Config
	kcfg   keyed.Config
	logger watermill.LoggerAdapter
	// unmarshal reads a delivery (Marshaler's; tests replace it).
	unmarshal func(amqp091.Delivery) (*message.Message, error)
	panics    atomic.Int64

	mu      sync.Mutex // orders Subscribe's wg.Add before Close's Wait
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup // one per Subscribe
}

// errNacked makes keyed.Partition run a nacked message again.
var errNacked = errors.New("amqp: message nacked")

// errSubscriberClosing ends a handler that could not hand its message out
// because the subscription is ending.
var errSubscriberClosing = errors.New("amqp: subscriber closing")

func newKeyedSubscriber(t *Transport, group string) *KeyedSubscriber {
	return &KeyedSubscriber{
		t: t, group: group, wcfg: t.config(group),
		kcfg:      keyed.Config{Concurrency: t.cfg.KeyParallelism, MaxInFlight: t.cfg.Prefetch},
		logger:    t.logger.With(watermill.LogFields{"consumer_group": group, "key_parallelism": t.cfg.KeyParallelism}),
		closing:   make(chan struct{}),
		unmarshal: Marshaler{}.Unmarshal,
	}
}

// Panics counts the panics recovered while handing deliveries out (see
// KeyedSubscriber): a delivery that panics is logged with its identity
// and run again in its key's place, and the subscription goes on.
func (s *KeyedSubscriber) Panics() int64 { return s.panics.Load() }

// Subscribe declares the topic's exchange and the group's queue (as
// watermill-amqp's subscriber does) and consumes the queue. The channel
// closes after ctx ends or Close, once the messages out were drained.
func (s *KeyedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("amqp: subscriber is closed")
	default:
	}
	queue := s.wcfg.Queue.GenerateName(topic)
	sub := &subscription{
		s: s, topic: topic, queue: queue,
		out:    make(chan *message.Message),
		fields: watermill.LogFields{"topic": topic, "amqp_queue_name": queue},
	}
	p, err := keyed.NewPartition(s.kcfg, sub.handle, func(int64) {}) // acks are per delivery: no watermark
	if err != nil {
		return nil, fmt.Errorf("amqp: key-parallel subscriber of queue %s: %w", queue, err)
	}
	p.OnPanic(sub.panicked)
	sub.part = p
	conn, err := s.dial(ctx, queue)
	if err != nil {
		return nil, err
	}
	cc, deliveries, err := sub.consume(ctx, conn)
	switch {
	case inExclusiveUse(err):
		// Another consumer holds the queue (a previous connection RabbitMQ
		// has not dropped yet, or a standby's active peer): run waits.
		sub.s.logger.Info(waitingForQueue, sub.fields.Add(watermill.LogFields{"reason": err.Error()}))
	case err != nil:
		_ = conn.CloseDeadline(time.Now().Add(s.t.cfg.ConnectTimeout))
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = conn.CloseDeadline(time.Now().Add(s.t.cfg.ConnectTimeout))
		return nil, errors.New("amqp: subscriber is closed")
	}
	s.wg.Add(1)
	s.mu.Unlock()
	ctx, cancel := keyed.WithClosing(ctx, s.closing)
	sub.done = ctx.Done()
	go func() {
		defer s.wg.Done()
		defer cancel()
		sub.run(ctx, conn, cc, deliveries)
	}()
	return sub.out, nil
}

// dial opens a connection for queue within ConnectTimeout, named so that
// RabbitMQ's management UI shows whose it is.
func (s *KeyedSubscriber) dial(ctx context.Context, queue string) (*amqp091.Connection, error) {
	ac := s.t.amqpCfg
	ac.Properties = amqp091.NewConnectionProperties()
	ac.Properties.SetClientConnectionName("millwright keyed subscriber " + queue)
	conn, err := dialAMQP(ctx, s.t.cfg.URL, ac, s.t.cfg.ConnectTimeout)
	if err != nil {
		return nil, connectError(s.t.cfg.URL, s.t.urlFrom, err)
	}
	return conn, nil
}

// SubscribeInitialize declares the topic's exchange and the group's
// queue, bound to it, as watermill-amqp's subscriber does.
func (s *KeyedSubscriber) SubscribeInitialize(topic string) error {
	queue := s.wcfg.Queue.GenerateName(topic)
	ctx, cancel := context.WithTimeout(context.Background(), s.t.cfg.ConnectTimeout)
	defer cancel()
	conn, err := s.dial(ctx, queue)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("amqp: opening a channel to declare queue %s: %w", queue, err)
	}
	defer func() { _ = ch.Close() }()
	return s.declare(ch, topic, queue)
}

func (s *KeyedSubscriber) declare(ch *amqp091.Channel, topic, queue string) error {
	if err := s.wcfg.TopologyBuilder.BuildTopology(ch, queue, s.wcfg.Exchange.GenerateName(topic), s.wcfg, s.logger); err != nil {
		return fmt.Errorf("amqp: declaring queue %s bound to exchange %s: %w", queue, topic, err)
	}
	return nil
}

// Close ends every subscription as described on KeyedSubscriber and
// waits for them. It is idempotent.
func (s *KeyedSubscriber) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// subscription is one Subscribe: one queue, one keyed.Partition across
// every connection it consumes on.
type subscription struct {
	s            *KeyedSubscriber
	topic, queue string
	fields       watermill.LogFields
	part         *keyed.Partition[delivery]
	seq          int64           // the partition's offsets: deliveries in arrival order, across channels
	done         <-chan struct{} // closed when the subscription ends

	// mu guards sends on out against its close: a handler the drain bound
	// gave up on may still be about to send.
	mu     sync.RWMutex
	closed bool
	out    chan *message.Message
}

// delivery is one delivery and the channel it came on.
type delivery struct {
	d  amqp091.Delivery
	on *consumerChannel
}

// consumerChannel is one channel consumed on. gone is closed when its
// deliveries end (the channel or connection closed): what was delivered
// on it and not acked is back in the queue, so a delivery of it not yet
// handed out is skipped.
type consumerChannel struct {
	ch       *amqp091.Channel
	tag      string
	gone     chan struct{}
	goneOnce sync.Once
}

func (c *consumerChannel) markGone() { c.goneOnce.Do(func() { close(c.gone) }) }

func (c *consumerChannel) isGone() bool {
	select {
	case <-c.gone:
		return true
	default:
		return false
	}
}

// run reads cc's deliveries and, after the connection or channel is
// lost, those of each new one, until ctx ends; then drains. A nil cc
// (Subscribe found the queue in exclusive use) starts with consuming
// again.
func (sub *subscription) run(ctx context.Context, conn *amqp091.Connection, cc *consumerChannel, deliveries <-chan amqp091.Delivery) {
	var delay time.Duration // it consumed: the first attempt is at once
	if cc == nil {
		delay = minBackoff
	}
	for {
		if cc != nil {
			if sub.read(ctx, cc, deliveries) {
				sub.stop(conn, cc)
				return
			}
			sub.s.logger.Error("AMQP key-parallel subscriber lost its channel; RabbitMQ requeues its unacked deliveries; reconnecting", sub.lostWhy(conn, cc), sub.fields)
			delay = 0
		}
		waiting := false
		for {
			_ = conn.CloseDeadline(time.Now().Add(sub.s.t.cfg.ConnectTimeout))
			if conn = sub.redial(ctx, &delay); conn == nil {
				sub.stop(nil, nil)
				return
			}
			var err error
			if cc, deliveries, err = sub.consume(ctx, conn); err == nil {
				break
			}
			cc = nil
			switch {
			case !inExclusiveUse(err):
				sub.s.logger.Error("AMQP key-parallel subscriber cannot consume its queue, retrying (check that the queue exists or can be declared with these arguments, and the user's permissions on it)", err, sub.fields)
			case !waiting:
				waiting = true
				sub.s.logger.Info(waitingForQueue, sub.fields.Add(watermill.LogFields{"reason": err.Error()}))
			}
			delay = nextBackoff(delay)
		}
	}
}

// waitingForQueue is logged when consuming is refused because another
// consumer holds the queue.
const waitingForQueue = "AMQP key-parallel subscriber waits for its queue: another consumer holds it exclusively, either this subscriber's previous connection, which RabbitMQ keeps (with its unacked deliveries) until its heartbeat timeout (about 30 s) when the client's side was lost, or another process of the consumer group (a standby then takes over when it stops); retrying every 5 s at most"

// inExclusiveUse reports whether err is RabbitMQ refusing a consume
// because another consumer holds the queue (ACCESS_REFUSED, "in
// exclusive use").
func inExclusiveUse(err error) bool {
	var ae *amqp091.Error
	return errors.As(err, &ae) && ae.Code == amqp091.AccessRefused && strings.Contains(ae.Reason, "exclusive")
}

func nextBackoff(d time.Duration) time.Duration { return min(max(2*d, minBackoff), maxBackoff) }

// consume opens a channel on conn, declares the topology, sets the QoS
// and starts consuming.
// A broker that stopped answering is noticed by the heartbeat; ctx's end
// closes conn, so that Close need not wait for that.
func (sub *subscription) consume(ctx context.Context, conn *amqp091.Connection) (*consumerChannel, <-chan amqp091.Delivery, error) {
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now().Add(sub.s.t.cfg.ConnectTimeout)) })
	defer stop()
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, fmt.Errorf("amqp: opening a channel for queue %s: %w", sub.queue, err)
	}
	if err := sub.s.declare(ch, sub.topic, sub.queue); err != nil {
		_ = ch.Close()
		return nil, nil, err
	}
	if err := ch.Qos(sub.s.t.cfg.Prefetch, 0, false); err != nil {
		_ = ch.Close()
		return nil, nil, fmt.Errorf("amqp: setting prefetch %d on the channel of queue %s: %w", sub.s.t.cfg.Prefetch, sub.queue, err)
	}
	c := sub.s.wcfg.Consume
	tag := "millwright-keyed-" + watermill.NewShortUUID()
	// Exclusive: no other consumer gets the queue's deliveries while this
	// one's are unacked (see KeyedSubscriber).
	deliveries, err := ch.Consume(sub.queue, tag, false, true, c.NoLocal, c.NoWait, c.Arguments)
	if err != nil {
		_ = ch.Close()
		return nil, nil, fmt.Errorf("amqp: consuming queue %s: %w", sub.queue, err)
	}
	sub.s.logger.Info("Consuming from AMQP queue (key-parallel)", sub.fields)
	cc := &consumerChannel{ch: ch, tag: tag, gone: make(chan struct{})}
	// Marked gone as soon as the channel closes, not only when the reader
	// next looks: fewer of its deliveries are handed out to be run twice.
	closes := ch.NotifyClose(make(chan *amqp091.Error, 1))
	go func() {
		<-closes // closed by amqp091 when the channel or connection closes
		sub.lost(cc)
	}()
	return cc, deliveries, nil
}

// lost marks cc gone and drops its deliveries that wait in the partition
// (behind their key's running message, or for a free slot): RabbitMQ
// requeued them with the channel and sends them again, so they give back
// their slots now, not when their key's running handler returns (a slow
// one would otherwise leave the new channel's deliveries no slot).
func (sub *subscription) lost(cc *consumerChannel) {
	if cc.isGone() {
		return
	}
	cc.markGone()
	if n := sub.part.Discard(func(d delivery) bool { return d.on == cc }); n > 0 {
		sub.s.logger.Debug("Dropped the waiting deliveries of a lost channel: RabbitMQ redelivers them", sub.fields.Add(watermill.LogFields{"deliveries": n}))
	}
}

// read submits cc's deliveries to the partition until they end (false:
// the channel is lost) or ctx does (true).
func (sub *subscription) read(ctx context.Context, cc *consumerChannel, deliveries <-chan amqp091.Delivery) bool {
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				sub.lost(cc)
				return ctx.Err() != nil
			}
			if cc.isGone() {
				continue // RabbitMQ requeued it with the channel
			}
			key, _ := d.Headers[metadata.OrderingKey].(string)
			sub.seq++
			if err := sub.part.Submit(ctx, key, sub.seq, delivery{d: d, on: cc}); err != nil {
				return true // ctx ended while Prefetch deliveries were in flight
			}
		case <-ctx.Done():
			return true
		}
	}
}

// lostWhy says why cc's deliveries ended.
func (sub *subscription) lostWhy(conn *amqp091.Connection, cc *consumerChannel) error {
	switch {
	case conn.IsClosed():
		return errors.New("connection closed (broker restart, network, or closed by an operator)")
	case cc.ch.IsClosed():
		return errors.New("channel closed by the broker (queue deleted, or a protocol error)")
	}
	return errors.New("consumer cancelled by the broker (queue deleted)")
}

// redial connects again after *delay (with jitter), then with growing
// backoff, until it connects or ctx ends (returning nil). *delay is the
// backoff reached, for the next call.
func (sub *subscription) redial(ctx context.Context, delay *time.Duration) *amqp091.Connection {
	for attempt := 1; ; attempt++ {
		if *delay > 0 {
			timer := time.NewTimer(time.Duration(float64(*delay) * (0.8 + 0.4*rand.Float64())))
			select {
			case <-ctx.Done():
				timer.Stop()
				return nil
			case <-timer.C:
			}
		}
		conn, err := sub.s.dial(ctx, sub.queue)
		if err == nil {
			sub.s.logger.Info("AMQP key-parallel subscriber reconnected", sub.fields.Add(watermill.LogFields{"attempts": attempt}))
			return conn
		}
		if ctx.Err() != nil {
			return nil
		}
		sub.s.logger.Error("AMQP key-parallel subscriber cannot reconnect, retrying", err, sub.fields.Add(watermill.LogFields{"attempt": attempt, "amqp_host": redact.URL(sub.s.t.cfg.URL)}))
		*delay = nextBackoff(*delay)
	}
}

// stop ends the subscription: it cancels the consumer, drains the
// partition within KeyDrainTimeout (acks still go out on cc), closes the
// channel and connection (RabbitMQ requeues what was not acked), then the
// output channel. conn and cc are nil when the connection was down.
func (sub *subscription) stop(conn *amqp091.Connection, cc *consumerChannel) {
	bound := sub.s.t.cfg.ConnectTimeout
	if cc != nil {
		bounded(bound, func() { _ = cc.ch.Cancel(cc.tag, false) })
	}
	ctx, cancel := context.WithTimeout(context.Background(), sub.s.t.cfg.KeyDrainTimeout)
	defer cancel()
	if _, _, finished := sub.part.Drain(ctx); !finished {
		sub.s.logger.Info("Handlers still running after KeyDrainTimeout: their messages' contexts are cancelled and RabbitMQ redelivers them", sub.fields)
	}
	if cc != nil {
		cc.markGone()
		bounded(bound, func() { _ = cc.ch.Close() })
	}
	if conn != nil {
		_ = conn.CloseDeadline(time.Now().Add(bound))
	}
	sub.closeOut()
	sub.s.logger.Info("Stopped consuming from AMQP queue (key-parallel)", sub.fields)
}

// bounded runs f and waits for it at most d: a channel operation waits
// for the broker's reply, which a broker that stopped answering (until the
// heartbeat notices) never sends.
func bounded(d time.Duration, f func()) {
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// closeOut closes the output channel once no handler is sending on it.
func (sub *subscription) closeOut() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.closed = true
	close(sub.out)
}

// handle is the partition's handler for one delivery: it hands the
// message out, waits for the Router's ack (then acks the delivery) or
// nack (errNacked: the partition runs it again in its key's place).
func (sub *subscription) handle(ctx context.Context, dl delivery) error {
	if dl.on.isGone() {
		return nil // its channel closed: RabbitMQ requeued it
	}
	msg, err := sub.s.unmarshal(dl.d)
	if err != nil {
		err = fmt.Errorf("amqp: unmarshaling delivery %d (message-id %q) of queue %s: %w", dl.d.DeliveryTag, dl.d.MessageId, sub.queue, err)
		sub.s.logger.Error("Cannot unmarshal an AMQP delivery: it holds its ordering key, unacked, until it is removed from the queue or the subscriber can read it", err, sub.fields)
		return err
	}
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)
	if gone, err := sub.send(ctx, dl.on, msg); gone || err != nil {
		return err
	}
	select {
	case <-msg.Acked():
		if err := dl.d.Ack(false); err != nil {
			sub.s.logger.Info("Ack of a finished message lost with its channel: RabbitMQ redelivers it (deduplicate with package idempotency)", sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID, "error": err.Error()}))
		}
		return nil
	case <-msg.Nacked():
		if dl.on.isGone() {
			return nil // RabbitMQ requeued it: it comes back in its key's place
		}
		return errNacked
	case <-ctx.Done():
		return ctx.Err() // drained past the bound: left unacked, redelivered
	}
}

// panicked logs a delivery whose handling panicked (keyed.Partition
// recovered it and runs it again in its key's place).
func (sub *subscription) panicked(dl delivery, perr *keyed.PanicError) {
	sub.s.panics.Add(1)
	key, _ := dl.d.Headers[metadata.OrderingKey].(string)
	sub.s.logger.Error("AMQP key-parallel subscriber recovered a panic handling a delivery: it runs again in its key's place after 100 ms (its key waits, other keys go on); a delivery that always panics holds its key, unacked, until fixed or removed from the queue", perr, sub.fields.Add(watermill.LogFields{
		"delivery_tag": dl.d.DeliveryTag, "message_id": dl.d.MessageId, "ordering_key": key, "stack": string(perr.Stack),
	}))
}

// send hands msg out. It reports gone when msg's channel closed first
// (the delivery is requeued), and an error when the subscription or ctx
// ended first.
func (sub *subscription) send(ctx context.Context, on *consumerChannel, msg *message.Message) (gone bool, err error) {
	sub.mu.RLock()
	defer sub.mu.RUnlock()
	if sub.closed {
		return false, errSubscriberClosing
	}
	select {
	case sub.out <- msg:
		return false, nil
	case <-on.gone:
		return true, nil
	case <-sub.done:
		return false, errSubscriberClosing
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

var _ message.SubscribeInitializer = (*KeyedSubscriber)(nil)
