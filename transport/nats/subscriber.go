package nats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/internal/keyed"
	"github.com/millwright/millwright/metadata"
)

// Subscriber consumes a topic's stream through the consumer group's
// durable JetStream consumer, created (or updated to Config's settings) by
// Subscribe and SubscribeInitialize. It is millwright's own, on nats.go's
// jetstream package (see the package doc for why not watermill-nats's).
//
// Messages go through a keyed.Partition, as in the key-parallel Kafka and
// RabbitMQ consumers:
//
//   - messages of one metadata.OrderingKey are handed out one at a time, in
//     stream order: the next only after the previous one's ack;
//   - with Config.KeyParallelism above 0, different keys are out at once,
//     up to KeyParallelism per subscription; with 0, one message at a
//     time (any key), in stream order;
//   - a message is acknowledged to the server (a double ack: the server
//     confirms it) only once the Router acked it, that is once its
//     handler finished: an ack never goes ahead of unfinished work;
//   - a nacked message runs again after 100 ms in its key's place,
//     holding its key: never nak'ed to the server, where it would come
//     back behind its key's later messages;
//   - every message held (handed out, or waiting behind its key) is kept
//     in progress: the subscriber sends JetStream's in-progress
//     acknowledgement for each every AckWait/3, so a handler slower than
//     AckWait is not overtaken by its own redelivery, and a redelivery
//     of a message the subscriber still holds (after a reconnection that
//     outlasted AckWait) is dropped, not run twice beside it;
//   - with Config.MaxDeliver set, a message delivered for the MaxDeliver-th
//     time (its earlier deliveries were never acknowledged: the consumer
//     died holding it, again and again) is published to
//     Config.DeadLetterTopic with its metadata and the dlq context
//     (MetadataDeadLetter*), and acknowledged, instead of being run a
//     last time and dropped by the server if that fails too;
//   - one member of a consumer group at a time receives its messages: the
//     group's consumer pins one pulling client (JetStream's pinned-client
//     priority policy), and the others wait as standbys. That is what
//     keeps a key in order across the group's members (JetStream would
//     otherwise hand a key's messages to whichever member pulls). When
//     the pinned member stops pulling (it died), the server pins another
//     after PinnedTTL, by which time the dead member's held messages are
//     back, ahead of their keys' later ones; a member that ends its
//     subscription unpins itself at once;
//   - the end of a subscription (Close, or Subscribe's ctx) stops fetching,
//     waits up to KeyDrainTimeout for the messages out, then, if every
//     handler returned, naks the messages it still holds in stream order
//     (the server gives them to the next consumer at once, in order);
//     otherwise it leaves them, and the server redelivers them, in stream
//     order, after AckWait.
type Subscriber struct {
	t      *Transport
	group  string
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup
	panics  atomic.Int64
}

// Dead-letter metadata set on a message MaxDeliver's end sends to
// Config.DeadLetterTopic.
const (
	MetadataDeadLetterTopic      = "nats_dead_letter_topic"
	MetadataDeadLetterGroup      = "nats_dead_letter_group"
	MetadataDeadLetterDeliveries = "nats_dead_letter_deliveries"
	MetadataDeadLetterStreamSeq  = "nats_dead_letter_stream_seq"
	MetadataDeadLetterReason     = "nats_dead_letter_reason"
)

var (
	errNacked            = errors.New("nats: message nacked")
	errSubscriberClosing = errors.New("nats: subscriber closing")
)

func newSubscriber(t *Transport, group string) *Subscriber {
	return &Subscriber{
		t: t, group: group,
		logger:  t.logger.With(watermill.LogFields{"consumer_group": group, "key_parallelism": t.cfg.KeyParallelism}),
		closing: make(chan struct{}),
	}
}

// Panics counts the panics recovered while handing messages out.
func (s *Subscriber) Panics() int64 { return s.panics.Load() }

// SubscribeInitialize creates topic's stream and the group's durable
// consumer, so that messages published before the first Subscribe are
// kept for the group.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	_, err := s.t.ensureConsumer(context.Background(), topic, s.group)
	return err
}

// Subscribe consumes topic through the group's durable consumer. The
// channel closes after ctx ends or Close, once the messages out were
// drained.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, errors.New("nats: subscriber is closed")
	}
	cons, err := s.t.ensureConsumer(ctx, topic, s.group)
	if err != nil {
		return nil, err
	}
	cfg := s.t.cfg
	conc := max(1, cfg.KeyParallelism)
	sub := &subscription{
		s: s, topic: topic, cons: cons,
		out:    make(chan *message.Message),
		held:   map[uint64]jetstream.Msg{},
		fields: watermill.LogFields{"topic": topic, "nats_stream": StreamName(topic), "nats_consumer": ConsumerName(s.group)},
	}
	p, err := keyed.NewPartition(keyed.Config{Concurrency: conc, MaxInFlight: cfg.MaxAckPending}, sub.handle, func(int64) {})
	if err != nil {
		return nil, fmt.Errorf("nats: subscriber of topic %s: %w", topic, err)
	}
	p.OnPanic(sub.panicked)
	sub.part = p
	it, err := sub.messages()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		it.Stop()
		return nil, errors.New("nats: subscriber is closed")
	}
	s.wg.Add(1)
	s.mu.Unlock()
	ctx, cancel := keyed.WithClosing(ctx, s.closing)
	sub.done = ctx.Done()
	go func() {
		defer s.wg.Done()
		defer cancel()
		sub.run(ctx, it)
	}()
	return sub.out, nil
}

// Close ends every subscription (see Subscriber) and waits for them. It
// is idempotent.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// subscription is one Subscribe.
type subscription struct {
	s      *Subscriber
	topic  string
	cons   jetstream.Consumer
	fields watermill.LogFields
	part   *keyed.Partition[jetstream.Msg]
	seq    int64 // the partition's offsets: messages in arrival order
	done   <-chan struct{}

	heldMu sync.Mutex
	held   map[uint64]jetstream.Msg // by stream sequence: submitted, not acked

	mu     sync.RWMutex // guards sends on out against its close
	closed bool
	out    chan *message.Message
}

// messages starts pulling: a few more messages than can run at once, so
// that few wait unheld in the client's buffer.
func (sub *subscription) messages() (jetstream.MessagesContext, error) {
	cfg := sub.s.t.cfg
	batch := min(cfg.MaxAckPending, max(16, 2*cfg.KeyParallelism))
	exp := pullExpiry(cfg)
	it, err := sub.cons.Messages(jetstream.PullMaxMessages(batch), jetstream.PullExpiry(exp), jetstream.PullHeartbeat(min(5*time.Second, exp/2)),
		jetstream.PullPriorityGroup(pinGroup))
	if err != nil {
		return nil, fmt.Errorf("nats: consuming stream %s through consumer %s: %w", StreamName(sub.topic), ConsumerName(sub.s.group), err)
	}
	return it, nil
}

// run submits the messages to the partition until ctx ends, then drains.
func (sub *subscription) run(ctx context.Context, it jetstream.MessagesContext) {
	stopProgress := sub.keepInProgress()
	defer stopProgress()
	sub.s.logger.Info("Consuming from NATS JetStream", sub.fields)
	delay := 100 * time.Millisecond
	// Redeliveries wait in reorder, sorted by stream sequence before they
	// run: JetStream serves its redelivery queue before new messages but
	// not in stream order (seen: 20, 7, 9..16, 6, 17..19 after a member
	// died), so a burst of them is collected until a new message comes
	// or none for reorderWindow, then submitted in stream order.
	var reorder []jetstream.Msg
	flush := func() bool {
		slices.SortFunc(reorder, func(a, b jetstream.Msg) int { return cmp.Compare(streamSeq(a), streamSeq(b)) })
		defer func() { reorder = reorder[:0] }()
		for _, m := range reorder {
			if !sub.submit(ctx, m) {
				return false // the rest stay held: given back at the end
			}
		}
		return true
	}
	stopped := false
	for !stopped && ctx.Err() == nil {
		var (
			m   jetstream.Msg
			err error
		)
		if len(reorder) > 0 {
			m, err = it.Next(jetstream.NextMaxWait(reorderWindow))
		} else {
			m, err = it.Next(jetstream.NextContext(ctx))
		}
		if err != nil {
			if len(reorder) > 0 && !flush() {
				break
			}
			if ctx.Err() != nil {
				break
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) || errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
				// The consumer was deleted, or the connection closed for
				// good: create it again and go on.
				sub.s.logger.Error("NATS subscriber lost its consumer, recreating it", err, sub.fields)
				it.Stop()
				if it = sub.resubscribe(ctx, &delay); it == nil {
					break
				}
				continue
			}
			// A quiet reorderWindow, missed heartbeats and the like: the
			// iterator goes on.
			continue
		}
		delay = 100 * time.Millisecond
		md, err := m.Metadata()
		if err != nil {
			sub.s.logger.Error("NATS message without JetStream metadata: skipped", err, sub.fields)
			continue
		}
		if !sub.hold(md.Sequence.Stream, m) {
			continue // a redelivery of a message still held: its first copy is running or waiting
		}
		if md.NumDelivered > 1 {
			reorder = append(reorder, m)
			continue
		}
		if len(reorder) > 0 && !flush() {
			break
		}
		stopped = !sub.submit(ctx, m)
	}
	// What the client pulled and never handed to run is delivered to
	// this member too: collect it, to give it back with the held ones.
	it.Drain()
	var buffered []jetstream.Msg
	for {
		m, err := it.Next(jetstream.NextMaxWait(time.Second))
		if err != nil {
			break
		}
		buffered = append(buffered, m)
	}
	sub.stop(buffered)
}

// reorderWindow is how long a burst of redeliveries is collected without
// a new message before it is sorted and run.
const reorderWindow = 100 * time.Millisecond

// submit hands m to the partition, or to the dead letter topic at
// MaxDeliver's end; false when the subscription is ending (m stays held,
// and is given back with the others).
func (sub *subscription) submit(ctx context.Context, m jetstream.Msg) bool {
	md, err := m.Metadata()
	if err != nil {
		return true
	}
	if mx := sub.s.t.cfg.MaxDeliver; mx > 1 && md.NumDelivered >= uint64(mx) {
		sub.deadLetter(ctx, m, md)
		return true
	}
	sub.seq++
	if err := sub.part.Submit(ctx, m.Headers().Get(metadata.OrderingKey), sub.seq, m); err != nil {
		return false
	}
	return true
}

// resubscribe creates the consumer again and starts pulling, with backoff,
// until it does (or ctx ends: nil).
func (sub *subscription) resubscribe(ctx context.Context, delay *time.Duration) jetstream.MessagesContext {
	for {
		t := time.NewTimer(*delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		*delay = min(2**delay, 5*time.Second)
		cons, err := sub.s.t.ensureConsumer(ctx, sub.topic, sub.s.group)
		if err != nil {
			sub.s.logger.Error("NATS subscriber cannot create its consumer, retrying", err, sub.fields)
			continue
		}
		sub.cons = cons
		it, err := sub.messages()
		if err != nil {
			sub.s.logger.Error("NATS subscriber cannot pull, retrying", err, sub.fields)
			continue
		}
		sub.s.logger.Info("NATS subscriber consuming again", sub.fields)
		return it
	}
}

// hold records m as held; false when a message of that stream sequence
// already is.
func (sub *subscription) hold(seq uint64, m jetstream.Msg) bool {
	sub.heldMu.Lock()
	defer sub.heldMu.Unlock()
	if _, dup := sub.held[seq]; dup {
		return false
	}
	sub.held[seq] = m
	return true
}

func (sub *subscription) release(seq uint64) {
	sub.heldMu.Lock()
	delete(sub.held, seq)
	sub.heldMu.Unlock()
}

// heldInOrder returns the held messages by stream sequence.
func (sub *subscription) heldInOrder() []jetstream.Msg {
	sub.heldMu.Lock()
	defer sub.heldMu.Unlock()
	seqs := make([]uint64, 0, len(sub.held))
	for s := range sub.held {
		seqs = append(seqs, s)
	}
	slices.Sort(seqs)
	out := make([]jetstream.Msg, len(seqs))
	for i, s := range seqs {
		out[i] = sub.held[s]
	}
	return out
}

// keepInProgress sends an in-progress acknowledgement for every held
// message each AckWait/3, until the returned func is called.
func (sub *subscription) keepInProgress() func() {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(sub.s.t.cfg.AckWait / 3)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				for _, m := range sub.heldInOrder() {
					_ = m.InProgress() // lost: the next tick sends it again
				}
			}
		}
	}()
	return func() { close(stop); <-done }
}

// streamSeq is m's stream sequence (0 when it has no JetStream metadata).
func streamSeq(m jetstream.Msg) uint64 {
	md, err := m.Metadata()
	if err != nil {
		return 0
	}
	return md.Sequence.Stream
}

// nakConfirmed naks m and waits for the server to confirm it (a nak sent
// as a request, as a double ack is), within ConnectTimeout; without the
// confirmation it falls back to a plain nak.
func (sub *subscription) nakConfirmed(m jetstream.Msg) {
	ctx, cancel := context.WithTimeout(context.Background(), sub.s.t.cfg.ConnectTimeout)
	defer cancel()
	if m.Reply() == "" {
		return
	}
	if _, err := sub.s.t.nc.RequestWithContext(ctx, m.Reply(), []byte("-NAK")); err != nil {
		_ = m.Nak()
	}
}

// stop drains the partition within KeyDrainTimeout, naks what is still
// held (and what was pulled and not yet handed out) when every handler
// returned, unpins the group, and closes the output channel.
func (sub *subscription) stop(buffered []jetstream.Msg) {
	ctx, cancel := context.WithTimeout(context.Background(), sub.s.t.cfg.KeyDrainTimeout)
	defer cancel()
	_, _, finished := sub.part.Drain(ctx)
	if finished {
		// Every message this member holds or pulled goes back in stream
		// order, each nak confirmed by the server before the next and
		// before the pin moves: the next member gets them first, ahead of
		// their keys' later messages.
		back := append(sub.heldInOrder(), buffered...)
		slices.SortFunc(back, func(a, b jetstream.Msg) int { return cmp.Compare(streamSeq(a), streamSeq(b)) })
		for _, m := range back {
			sub.nakConfirmed(m)
		}
		// Hand the pin on now (the held messages first, in order), not
		// after PinnedTTL.
		uctx, cancel := context.WithTimeout(context.Background(), sub.s.t.cfg.ConnectTimeout)
		if s, err := sub.s.t.js.Stream(uctx, StreamName(sub.topic)); err == nil {
			_ = s.UnpinConsumer(uctx, ConsumerName(sub.s.group), pinGroup)
		}
		cancel()
	} else {
		sub.s.logger.Info("Handlers still running after KeyDrainTimeout: their messages' contexts are cancelled, and the server redelivers every held message, in stream order, after AckWait", sub.fields)
	}
	sub.closeOut()
	sub.s.logger.Info("Stopped consuming from NATS JetStream", sub.fields)
}

func (sub *subscription) closeOut() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.closed = true
	close(sub.out)
}

// handle is the partition's handler for one message: it hands it out and
// waits for the Router's ack (then acknowledges it to the server) or nack
// (errNacked: the partition runs it again in its key's place).
func (sub *subscription) handle(ctx context.Context, m jetstream.Msg) error {
	md, err := m.Metadata()
	if err != nil {
		return nil // checked in run
	}
	msg := Unmarshal(m)
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)
	if err := sub.send(ctx, msg); err != nil {
		return err
	}
	select {
	case <-msg.Acked():
		actx, cancel := context.WithTimeout(context.Background(), sub.s.t.cfg.ConnectTimeout)
		defer cancel()
		if err := m.DoubleAck(actx); err != nil {
			sub.s.logger.Info("Acknowledgement of a finished message not confirmed: the server may deliver it again (deduplicate with package idempotency)", sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID, "stream_seq": md.Sequence.Stream, "error": err.Error()}))
		}
		sub.release(md.Sequence.Stream)
		return nil
	case <-msg.Nacked():
		return errNacked
	case <-ctx.Done():
		return ctx.Err() // drained past the bound: held, redelivered
	}
}

// send hands msg out, or fails when the subscription or ctx ends first.
func (sub *subscription) send(ctx context.Context, msg *message.Message) error {
	sub.mu.RLock()
	defer sub.mu.RUnlock()
	if sub.closed {
		return errSubscriberClosing
	}
	select {
	case sub.out <- msg:
		return nil
	case <-sub.done:
		return errSubscriberClosing
	case <-ctx.Done():
		return ctx.Err()
	}
}

// panicked logs a message whose handing out panicked (the partition
// recovered it and runs it again in its key's place).
func (sub *subscription) panicked(m jetstream.Msg, perr *keyed.PanicError) {
	sub.s.panics.Add(1)
	sub.s.logger.Error("NATS subscriber recovered a panic handing a message out: it runs again in its key's place after 100 ms", perr, sub.fields.Add(watermill.LogFields{
		"message_uuid": m.Headers().Get(UUIDHeader), "ordering_key": m.Headers().Get(metadata.OrderingKey), "stack": string(perr.Stack),
	}))
}

// deadLetter publishes m, delivered for the MaxDeliver-th time, to
// Config.DeadLetterTopic with its context, then acknowledges it; when the
// publish fails, m is left held (in progress) and tried again after a
// pause, so that it is never dropped.
func (sub *subscription) deadLetter(ctx context.Context, m jetstream.Msg, md *jetstream.MsgMetadata) {
	cfg := sub.s.t.cfg
	for {
		msg := Unmarshal(m)
		msg.Metadata.Set(MetadataDeadLetterTopic, sub.topic)
		msg.Metadata.Set(MetadataDeadLetterGroup, sub.s.group)
		msg.Metadata.Set(MetadataDeadLetterDeliveries, fmt.Sprint(md.NumDelivered))
		msg.Metadata.Set(MetadataDeadLetterStreamSeq, fmt.Sprint(md.Sequence.Stream))
		msg.Metadata.Set(MetadataDeadLetterReason, fmt.Sprintf("delivered %d times (MaxDeliver %d) without an acknowledgement within AckWait %s: the consumers holding it died or stalled; not run again", md.NumDelivered, cfg.MaxDeliver, cfg.AckWait))
		pctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
		msg.SetContext(pctx)
		err := sub.s.t.pub.Publish(cfg.DeadLetterTopic, msg)
		cancel()
		if err == nil {
			sub.s.logger.Error("NATS message reached MaxDeliver: sent to the dead letter topic", nil, sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID, "dead_letter_topic": cfg.DeadLetterTopic, "deliveries": md.NumDelivered}))
			actx, cancel := context.WithTimeout(context.Background(), cfg.ConnectTimeout)
			_ = m.DoubleAck(actx)
			cancel()
			sub.release(md.Sequence.Stream)
			return
		}
		sub.s.logger.Error("NATS message reached MaxDeliver but the dead letter topic refused it: kept in progress and tried again", err, sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID, "dead_letter_topic": cfg.DeadLetterTopic}))
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

var _ message.SubscribeInitializer = (*Subscriber)(nil)
