package kafka

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/keyed"
)

// KeyedSubscriber is millwright's key-parallel Kafka consumer, selected by
// Config.KeyParallelism for consumer groups. watermill-kafka's subscriber
// sends a partition's next message only after the previous one's ack
// (watermill#374; watermill-kafka#29 is the unmerged fix), so a handler
// that takes 5 ms caps a partition at 200 msg/s. KeyedSubscriber reads
// each claimed partition through a keyed.Partition:
//
//   - messages with one Kafka key (the ordering key: the aggregate) are
//     sent to the output channel one at a time, in offset order: the next
//     only after the previous one's ack;
//   - messages of different keys are out at the same time, up to
//     KeyParallelism per partition; Watermill's Router runs each message
//     it reads in its own goroutine, so every middleware (idempotency,
//     retry, dlq, tracing) works unchanged;
//   - the partition's offset is marked only up to the oldest message not
//     acked, so a crash or a rebalance redelivers only unfinished work
//     (and finished work above it: at least once);
//   - at most KeyMaxInFlight messages per partition are fetched and not
//     acked: the fetch of that partition waits beyond that;
//   - a nacked message is sent again after NackResendSleep (100 ms), in
//     its key's place, holding its key and the partition's offset;
//   - a partition revoked by a rebalance, or the subscriber closing,
//     starts nothing new (a message not yet read from the output channel
//     is not waited for), waits for the messages out up to
//     Config.KeyDrainTimeout (default 30 s), marks the final offset,
//     commits and releases the partition. The group's rebalance timeout
//     (Consumer.Group.Rebalance.Timeout) is raised to 4/3 of that bound,
//     and Sarama keeps heartbeating while the partition drains, so the
//     member stays in the group while it waits: a handler slower than a
//     few seconds is not cancelled and run again by the partition's next
//     owner at every rebalance (which would repeat an effect outside the
//     database, or one marked by idempotency after success, and with
//     frequent rebalances never get past it). The cost: a rebalance
//     lasts as long as the slowest running handler, up to the bound.
//     Handlers still running after it are no longer waited for (their
//     message's context is cancelled) and the partition's next owner
//     gets them again;
//   - a panic while a message is handed out (unmarshaling it, for one) is
//     recovered: logged with the message's partition, offset, key and
//     stack, counted (Panics), and the message is run again after 100 ms
//     in its key's place, like a nack; the partition goes on. (A panic in
//     the Router's handler is the Router's: use Watermill's
//     middleware.Recoverer, which turns it into a nack.)
//
// Messages without a key have no order among themselves. The Router's
// handler must be safe for concurrent use (Router handlers are: the
// Router already runs one goroutine per message). The message context
// does not carry watermill-kafka's partition, offset and key values
// (wkafka.MessagePartitionFromCtx and the like): their setters are not
// exported.
//
// An empty consumer group gets watermill-kafka's subscriber: without a
// group nothing is committed, so there is nothing to keep in order.
type KeyedSubscriber struct {
	brokers     []string
	group       string
	sc          *sarama.Config
	cfg         keyed.Config
	drain       time.Duration
	details     *sarama.TopicDetail
	unmarshaler wkafka.Unmarshaler
	logger      watermill.LoggerAdapter
	panics      atomic.Int64
	live        keyedLive // the partitions held now, for LagReader (keyed_lag.go)

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup // one per Subscribe's consume loop
}

// errNacked makes keyed.Partition run a nacked message again.
var errNacked = errors.New("kafka: message nacked")

// errClosing ends a handler that could not hand its message out because
// the subscriber is closing.
var errClosing = errors.New("kafka: subscriber closing")

// keyedRebalanceTimeout is the group's rebalance timeout for a drain bound
// d: the bound plus a third, for the rejoin after it.
func keyedRebalanceTimeout(d time.Duration) time.Duration { return d + d/3 }

func newKeyedSubscriber(c Config, group string, sc *sarama.Config, logger watermill.LoggerAdapter) (*KeyedSubscriber, error) {
	if !sc.Consumer.Offsets.AutoCommit.Enable {
		return nil, errors.New("kafka: the key-parallel consumer (KeyParallelism) commits through Sarama's auto-commit: keep Consumer.Offsets.AutoCommit.Enable on in Config.Tune")
	}
	kc := keyed.Config{Concurrency: c.KeyParallelism, MaxInFlight: c.KeyMaxInFlight}
	drain := min(c.KeyDrainTimeout, sc.Consumer.Group.Rebalance.Timeout*3/4)
	return &KeyedSubscriber{
		brokers: c.Brokers, group: group, sc: sc, cfg: kc, drain: drain,
		details:     &sarama.TopicDetail{NumPartitions: c.Partitions, ReplicationFactor: c.ReplicationFactor},
		unmarshaler: Marshaler{},
		logger:      logger.With(watermill.LogFields{"consumer_group": group, "key_parallelism": c.KeyParallelism}),
		closing:     make(chan struct{}),
	}, nil
}

// Subscribe joins the consumer group for topic. The channel closes after
// ctx ends or Close, once every partition is released.
func (s *KeyedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("kafka: subscriber is closed")
	default:
	}
	client, err := sarama.NewClient(s.brokers, s.sc)
	if err != nil {
		return nil, fmt.Errorf("kafka: key-parallel subscriber of group %q: connecting to %s: %w", s.group, strings.Join(s.brokers, ","), err)
	}
	group, err := sarama.NewConsumerGroupFromClient(s.group, client)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("kafka: key-parallel subscriber: joining group %q: %w", s.group, err)
	}
	out := make(chan *message.Message)
	ctx, cancel := keyed.WithClosing(ctx, s.closing)
	h := &keyedHandler{s: s, out: out, topic: topic}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer cancel()
		go s.logErrors(group, topic)
		s.consume(ctx, group, topic, h)
		_ = group.Close() // closes Errors(), ending logErrors
		_ = client.Close()
		h.closeOut()
	}()
	return out, nil
}

// consume runs the group's sessions until ctx ends: Consume returns at
// each rebalance and must be called again.
func (s *KeyedSubscriber) consume(ctx context.Context, group sarama.ConsumerGroup, topic string, h *keyedHandler) {
	for ctx.Err() == nil {
		err := group.Consume(ctx, []string{topic}, h)
		switch {
		case err == nil, ctx.Err() != nil:
		case errors.Is(err, sarama.ErrClosedConsumerGroup):
			return
		default:
			s.logger.Error("Kafka consumer group session failed; joining again in 1s", err, watermill.LogFields{"topic": topic})
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

func (s *KeyedSubscriber) logErrors(group sarama.ConsumerGroup, topic string) {
	for err := range group.Errors() {
		s.logger.Error("Kafka consumer group error", err, watermill.LogFields{"topic": topic})
	}
}

// Close leaves the group: partitions are drained as on a rebalance. It is
// idempotent.
func (s *KeyedSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}

// SubscribeInitialize creates topic with Config.Partitions and
// ReplicationFactor, as watermill-kafka's subscriber does.
func (s *KeyedSubscriber) SubscribeInitialize(topic string) error {
	admin, err := sarama.NewClusterAdmin(s.brokers, s.sc)
	if err != nil {
		return fmt.Errorf("kafka: creating cluster admin on %s: %w", strings.Join(s.brokers, ","), err)
	}
	defer func() { _ = admin.Close() }()
	if err := admin.CreateTopic(topic, s.details, false); err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return fmt.Errorf("kafka: creating topic %s: %w", topic, err)
	}
	return nil
}

// keyedHandler is the sarama.ConsumerGroupHandler of one Subscribe.
type keyedHandler struct {
	s     *KeyedSubscriber
	out   chan *message.Message
	topic string

	// mu guards sends on out against its close: a handler the drain bound
	// gave up on may still be about to send when the last session ends.
	mu     sync.RWMutex
	closed bool
}

// closeOut closes the output channel once no delivery is sending on it.
func (h *keyedHandler) closeOut() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	close(h.out)
}

// send hands msg to the output channel, unless it is closed or closing,
// its partition is draining (stopping: the message has not started, so
// the drain need not wait for it; the partition's next owner gets it), or
// ctx ends first.
func (h *keyedHandler) send(ctx context.Context, msg *message.Message, stopping <-chan struct{}) error {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.closed {
		return errClosing
	}
	select {
	case h.out <- msg:
		return nil
	case <-h.s.closing:
		return errClosing
	case <-stopping:
		return errClosing
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (h *keyedHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (h *keyedHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim feeds one partition to a keyed.Partition until the session
// ends, then drains it.
func (h *keyedHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	topic, part := claim.Topic(), claim.Partition()
	var p *keyed.Partition[*sarama.ConsumerMessage]
	p, err := keyed.NewPartition(h.s.cfg, func(ctx context.Context, km *sarama.ConsumerMessage) error {
		return h.deliver(ctx, km, p.Stopping()) // p is set before the first Submit
	}, func(next int64) { sess.MarkOffset(topic, part, next, "") })
	if err != nil {
		return err
	}
	p.OnPanic(h.panicked)
	h.s.live.track(topic, part, p)
	defer h.s.live.untrack(topic, part, p)
	defer h.drain(sess, p, topic, part)
	for {
		select {
		case km, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			if err := p.Submit(sess.Context(), string(km.Key), km.Offset, km); err != nil {
				return nil // the session ended while the partition was full
			}
		case <-sess.Context().Done():
			return nil
		case <-h.s.closing:
			return nil
		}
	}
}

// panicked logs a message whose handling panicked (keyed.Partition
// recovered it and runs it again in its key's place).
func (h *keyedHandler) panicked(km *sarama.ConsumerMessage, perr *keyed.PanicError) {
	h.s.panics.Add(1)
	h.s.logger.Error("Kafka key-parallel subscriber recovered a panic handling a message: it runs again in its key's place after 100 ms (its key and the partition's offset wait, other keys go on); a message that always panics holds them until fixed", perr, watermill.LogFields{
		"topic": km.Topic, "kafka_partition": km.Partition, "kafka_offset": km.Offset, "kafka_key": string(km.Key), "stack": string(perr.Stack),
	})
}

// Panics counts the panics recovered while handing messages out (see
// KeyedSubscriber): a message that panics is logged with its partition,
// offset and key and run again in its key's place, and the partition
// goes on.
func (s *KeyedSubscriber) Panics() int64 { return s.panics.Load() }

// drain stops p within the drain bound and commits its final offset.
func (h *keyedHandler) drain(sess sarama.ConsumerGroupSession, p *keyed.Partition[*sarama.ConsumerMessage], topic string, part int32) {
	ctx, cancel := context.WithTimeout(context.Background(), h.s.drain)
	defer cancel()
	next, known, finished := p.Drain(ctx)
	fields := watermill.LogFields{"topic": topic, "kafka_partition": part, "committed_offset": next}
	if !known {
		return
	}
	sess.MarkOffset(topic, part, next, "")
	sess.Commit()
	if !finished {
		h.s.logger.Info("Released a partition with handlers still running after the drain bound (KeyDrainTimeout, at most 3/4 of Sarama's Consumer.Group.Rebalance.Timeout): their messages, from the committed offset on, go to the partition's next owner", fields)
		return
	}
	h.s.logger.Debug("Released a drained partition", fields)
}

// deliver hands one message to the output channel and waits for its ack
// (nil) or nack (errNacked: keyed.Partition sends it again).
func (h *keyedHandler) deliver(ctx context.Context, km *sarama.ConsumerMessage, stopping <-chan struct{}) error {
	msg, err := h.s.unmarshaler.Unmarshal(km)
	if err != nil {
		err = fmt.Errorf("kafka: unmarshaling %s partition %d offset %d: %w", km.Topic, km.Partition, km.Offset, err)
		h.s.logger.Error("Cannot unmarshal a Kafka message: it holds its key and the partition's offset until fixed", err, nil)
		return err
	}
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)
	if err := h.send(ctx, msg, stopping); err != nil {
		return err
	}
	select {
	case <-msg.Acked():
		return nil
	case <-msg.Nacked():
		return errNacked
	case <-ctx.Done():
		return ctx.Err()
	}
}

var _ message.SubscribeInitializer = (*KeyedSubscriber)(nil)
