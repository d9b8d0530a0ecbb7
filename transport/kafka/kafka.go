package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/xdg-go/scram"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/closers"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// SASL mechanisms accepted in SASL.Mechanism.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
)

// DefaultVersion is Config.Version's default: the highest Kafka protocol
// version Sarama 1.43.3 speaks, tested against Kafka 4.1.1 (Kafka 4.x
// accepts clients from 2.1 on, KIP-896).
const DefaultVersion = "3.6.0"

// KfakeVersion is the highest protocol version that works against
// franz-go's kfake, which transport/embedded sets: from 2.4.0 on, Sarama
// 1.43.3 asks for committed offsets with OffsetFetch v6+, whose answer may
// carry a null metadata string for a partition without a commit; Kafka
// sends "" there but kfake sends null, which Sarama cannot decode, so a
// consumer group on kfake never starts.
const KfakeVersion = "2.3.0"

// Config is transport.KafkaConfig: the settings live in package transport, so that
// a program links only the kinds it imports.
type Config = transport.KafkaConfig

// SASL is transport.KafkaSASL: the settings live in package transport, so that
// a program links only the kinds it imports.
type SASL = transport.KafkaSASL

func setDefaults(c *Config) {
	if c.ClientID == "" {
		c.ClientID = "millwright"
	}
	if c.InitialOffset == "" {
		c.InitialOffset = "oldest"
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
	if c.Partitions == 0 {
		c.Partitions = 8
	}
	if c.ReplicationFactor == 0 {
		c.ReplicationFactor = 1
	}
	if c.Partitioner == "" {
		c.Partitioner = PartitionerMurmur2
	}
	if c.Version == "" {
		c.Version = DefaultVersion
	}
	if c.KeyDrainTimeout == 0 {
		c.KeyDrainTimeout = 30 * time.Second
	}
}

// validate reports configuration that cannot work, naming the field
// (Config.Validate, through the registered driver).
func validate(c Config) error {
	var errs []error
	switch {
	case c.Fake && len(c.Brokers) > 0:
		errs = append(errs, fmt.Errorf("kafka: Fake starts its own in-process broker, but Brokers is set (%s): unset MILLWRIGHT_KAFKA_BROKERS, or select the real cluster with kafka://host:9092", strings.Join(c.Brokers, ",")))
	case c.Fake && loadFake() == nil:
		errs = append(errs, errors.New(`kafka: Fake (the in-process development fake, kfake) is not linked into this program: add import _ "github.com/millwright/millwright/transport/embedded"`))
	case !c.Fake && len(c.Brokers) == 0:
		errs = append(errs, errors.New("kafka: Brokers is empty: set at least one host:port (env MILLWRIGHT_KAFKA_BROKERS or kafka://host:9092), or use the in-process development fake (MILLWRIGHT_TRANSPORT=kfake)"))
	}
	for _, b := range c.Brokers {
		if err := checkBroker(b); err != nil {
			errs = append(errs, err)
		}
	}
	if _, ok := c.Tune.(func(*sarama.Config)); c.Tune != nil && !ok {
		errs = append(errs, fmt.Errorf("kafka: Tune is a %T: want a func(*sarama.Config) (github.com/IBM/sarama)", c.Tune))
	}
	switch c.InitialOffset {
	case "", "oldest", "newest":
	default:
		errs = append(errs, fmt.Errorf("kafka: InitialOffset %q: want oldest or newest", c.InitialOffset))
	}
	switch strings.ToUpper(c.SASL.Mechanism) {
	case "":
	case SASLPlain, SASLScramSHA256, SASLScramSHA512:
		if c.SASL.User == "" {
			errs = append(errs, fmt.Errorf("kafka: SASL mechanism %s needs a user", c.SASL.Mechanism))
		}
	default:
		errs = append(errs, fmt.Errorf("kafka: SASL mechanism %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", c.SASL.Mechanism))
	}
	if c.Partitions < 0 {
		errs = append(errs, fmt.Errorf("kafka: Partitions %d is negative", c.Partitions))
	}
	errs = append(errs, validateKeyed(c)...)
	if c.ConnectTimeout < 0 {
		errs = append(errs, fmt.Errorf("kafka: ConnectTimeout %s is negative", c.ConnectTimeout))
	}
	switch c.Partitioner {
	case "", PartitionerMurmur2, PartitionerFNV1a:
	default:
		errs = append(errs, fmt.Errorf("kafka: Partitioner %q: want %s (default, the Java client's) or %s (Sarama's hash partitioner); env MILLWRIGHT_KAFKA_PARTITIONER or kafka://...?partitioner=", c.Partitioner, PartitionerMurmur2, PartitionerFNV1a))
	}
	if c.Version != "" {
		if _, err := parseVersion(c.Version); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// validateKeyed checks the key-parallel consumer's settings.
func validateKeyed(c Config) []error {
	var errs []error
	if c.KeyParallelism < 0 {
		errs = append(errs, fmt.Errorf("kafka: KeyParallelism %d is negative: want 0 (off: one message per partition at a time) or the keys handled at once per partition (env MILLWRIGHT_KAFKA_KEY_PARALLELISM)", c.KeyParallelism))
	}
	if c.KeyMaxInFlight < 0 || (c.KeyMaxInFlight > 0 && c.KeyMaxInFlight < c.KeyParallelism) {
		errs = append(errs, fmt.Errorf("kafka: KeyMaxInFlight %d: want 0 (default 16 x KeyParallelism) or at least KeyParallelism %d (env MILLWRIGHT_KAFKA_KEY_MAX_IN_FLIGHT)", c.KeyMaxInFlight, c.KeyParallelism))
	}
	if c.KeyDrainTimeout < 0 {
		errs = append(errs, fmt.Errorf("kafka: KeyDrainTimeout %s is negative: want 0 (default 30s) or how long a revoked partition waits for its running handlers", c.KeyDrainTimeout))
	}
	return errs
}

// FakeStarter starts an in-process Kafka and returns its brokers and a
// function that stops it.
type FakeStarter func() (brokers []string, stop func(), err error)

var fakeStarter atomic.Pointer[FakeStarter]

// RegisterFake makes Config.Fake start clusters with start. Package
// transport/embedded registers franz-go's kfake, so that programs which
// do not import it (production builds) do not link the fake.
func RegisterFake(start FakeStarter) { fakeStarter.Store(&start) }

func loadFake() *FakeStarter { return fakeStarter.Load() }

// checkBroker refuses a broker address Sarama would only fail to dial:
// one without a host (":9092" dials nothing useful) or with a bad port.
func checkBroker(b string) error {
	host, port, err := net.SplitHostPort(strings.TrimSpace(b))
	if err != nil {
		return fmt.Errorf("kafka: broker address %q: want host:port, e.g. 127.0.0.1:9092", b)
	}
	if host == "" {
		return fmt.Errorf("kafka: broker address %q has no host: want host:port, e.g. 127.0.0.1%s (or MILLWRIGHT_TRANSPORT=kfake for the in-process development fake)", b, b)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("kafka: broker address %q: port %q is not a number from 1 to 65535", b, port)
	}
	return nil
}

// parseVersion parses Config.Version.
func parseVersion(s string) (sarama.KafkaVersion, error) {
	v, err := sarama.ParseKafkaVersion(s)
	if err != nil {
		return v, fmt.Errorf("kafka: Version %q: want a Kafka version such as %s (the broker's version or lower; %s for kfake): %v", s, DefaultVersion, KfakeVersion, err)
	}
	if !v.IsAtLeast(sarama.V0_11_0_0) {
		return v, fmt.Errorf("kafka: Version %q: want 0.11.0.0 or later: older protocols have no message headers, which carry the metadata", s)
	}
	return v, nil
}

// Transport is an open connection to a Kafka cluster.
type Transport struct {
	cfg      Config
	stopFake func() // stops Config.Fake's cluster; nil without one
	logger   watermill.LoggerAdapter
	pub      *Publisher

	subs closers.Set
}

// Open checks the configuration, reaches the cluster within ConnectTimeout
// and creates the publisher. It makes one attempt: transport.Open is what
// waits for a cluster that is down (transport.Config.WaitForBroker). An
// error that waiting cannot fix (configuration, credentials refused, a
// listener that does not speak the configured TLS or SASL) is marked
// failure.Permanent. Errors name settings as kafka.Config fields.
func Open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (*Transport, error) {
	return open(ctx, cfg, logger, fieldSettings)
}

func saramaConfig(c Config) (*sarama.Config, error) {
	sc := wkafka.DefaultSaramaSubscriberConfig() // a superset of the publisher's defaults
	sc.ClientID = c.ClientID
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	tuneProducer(sc) // acks, idempotence, in-flight requests, retries: producer.go
	part, err := partitioner(c.Partitioner)
	if err != nil {
		return nil, err
	}
	sc.Producer.Partitioner = part
	sc.Net.DialTimeout = c.ConnectTimeout
	sc.Metadata.Retry.Max = 2
	sc.Metadata.Retry.Backoff = 250 * time.Millisecond
	sc.Admin.Timeout = 30 * time.Second
	sc.ChannelBufferSize = 10240
	sc.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	sc.Consumer.Group.Rebalance.Timeout = 3 * time.Second
	if c.KeyParallelism > 0 {
		// The key-parallel consumer waits up to KeyDrainTimeout for a
		// revoked partition's handlers before it rejoins: the group must
		// wait for it that long, or it falls out of the generation.
		sc.Consumer.Group.Rebalance.Timeout = max(sc.Consumer.Group.Rebalance.Timeout, keyedRebalanceTimeout(c.KeyDrainTimeout))
	}
	if sc.Version, err = parseVersion(c.Version); err != nil {
		return nil, err
	}
	if c.InitialOffset == "newest" {
		sc.Consumer.Offsets.Initial = sarama.OffsetNewest
	} else {
		sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	}
	if c.TLS != nil {
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = c.TLS
	}
	if m := strings.ToUpper(c.SASL.Mechanism); m != "" {
		sc.Net.SASL.Enable = true
		sc.Net.SASL.User = c.SASL.User
		sc.Net.SASL.Password = c.SASL.Password
		sc.Net.SASL.Handshake = true
		switch m {
		case SASLPlain:
			sc.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		case SASLScramSHA256:
			sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
			sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA256} }
		case SASLScramSHA512:
			sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
			sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA512} }
		}
	}
	if tune, ok := c.Tune.(func(*sarama.Config)); ok {
		tune(sc)
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: invalid Sarama configuration: %w", err)
	}
	return sc, nil
}

// Publisher returns the transport's publisher; it is safe for concurrent use
// and implements transport.BatchPublisher.
func (t *Transport) Publisher() message.Publisher { return t.pub }

// Subscriber returns a subscriber in consumer group `group`. An empty group
// reads every partition without committing offsets (each subscriber gets
// every message).
//
// With Config.KeyParallelism above 0 and a group, the subscriber is a
// KeyedSubscriber: keys in parallel within each partition, offsets
// committed in order.
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	if t.cfg.KeyParallelism > 0 && group != "" {
		sub, err := closers.Add(&t.subs, "kafka", func() (*KeyedSubscriber, error) {
			sc, err := saramaConfig(t.cfg)
			if err != nil {
				return nil, err
			}
			return newKeyedSubscriber(t.cfg, group, sc, t.logger)
		})
		if err != nil {
			return nil, err
		}
		return sub, nil
	}
	sub, err := closers.Add(&t.subs, "kafka", func() (*wkafka.Subscriber, error) {
		sc, err := saramaConfig(t.cfg)
		if err != nil {
			return nil, err
		}
		details := &sarama.TopicDetail{NumPartitions: t.cfg.Partitions, ReplicationFactor: t.cfg.ReplicationFactor}
		sub, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
			Brokers:                t.cfg.Brokers,
			Unmarshaler:            Marshaler{},
			OverwriteSaramaConfig:  sc,
			ConsumerGroup:          group,
			InitializeTopicDetails: details,
		}, t.logger)
		if err != nil {
			return nil, fmt.Errorf("kafka: creating subscriber for group %q: %w", group, err)
		}
		return sub, nil
	})
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return sub, nil
}

// Close closes every subscriber made by the transport, then the publisher.
// It is idempotent.
func (t *Transport) Close() error {
	return t.subs.Close(t.pub.Close, func() error {
		if t.stopFake != nil {
			t.stopFake()
		}
		return nil
	})
}

// Marshaler is watermill-kafka's default marshaler plus the ordering key
// and the CloudEvents Kafka binding (binary mode):
//
//   - a message carrying metadata.OrderingKey gets it as its Kafka key;
//     other messages get no key (Sarama then spreads them over partitions);
//   - CloudEvents attributes travel as "ce_<attr>" headers, the names the
//     metadata keys already have, except datacontenttype, which travels as
//     the "content-type" header; Unmarshal maps it back to
//     metadata.EventDataContentType.
type Marshaler struct{ wkafka.DefaultMarshaler }

// Marshal implements wkafka.Marshaler.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.DefaultMarshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	if k := msg.Metadata.Get(metadata.OrderingKey); k != "" {
		pm.Key = sarama.StringEncoder(k)
	}
	for i, h := range pm.Headers {
		if w := cloudevent.Kafka.WireKey(string(h.Key)); w != string(h.Key) {
			pm.Headers[i].Key = []byte(w)
		}
	}
	return pm, nil
}

// Unmarshal implements wkafka.Unmarshaler.
func (m Marshaler) Unmarshal(km *sarama.ConsumerMessage) (*message.Message, error) {
	msg, err := m.DefaultMarshaler.Unmarshal(km)
	if err != nil {
		return nil, err
	}
	cloudevent.Kafka.Decode(msg.Metadata)
	return msg, nil
}

// Publisher publishes through one Sarama sync producer. Publish sends
// messages one by one, as watermill-kafka does; PublishBatch hands Sarama
// the whole batch at once.
type Publisher struct {
	client    sarama.Client
	producer  sarama.SyncProducer
	marshaler wkafka.Marshaler
	logger    watermill.LoggerAdapter

	// ready holds the topics known to have a leader for every partition.
	ready sync.Map
	// topicWait bounds the wait for a new topic's leaders.
	topicWait time.Duration

	closeOnce sync.Once
	mu        sync.RWMutex
	closed    bool
}

// Publish sends msgs to topic in order, waiting for each acknowledgement.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return errors.New("kafka: publisher is closed")
	}
	if len(msgs) > 0 {
		if err := p.awaitTopic(msgs[0].Context(), topic); err != nil {
			return err
		}
	}
	for _, msg := range msgs {
		km, err := p.marshaler.Marshal(topic, msg)
		if err != nil {
			return fmt.Errorf("kafka: marshaling message %s: %w", msg.UUID, err)
		}
		if _, _, err := p.producer.SendMessage(km); err != nil {
			return fmt.Errorf("kafka: publishing message %s to %s: %w", msg.UUID, topic, p.classify(km, err))
		}
	}
	return nil
}

// PublishBatch sends msgs to topic with as few round trips as ordering
// allows. On partial failure it returns a *batch.Error
// (transport.BatchError) naming the messages that were not acknowledged.
//
// Sarama does not stop the messages behind a failed one: when a message
// exhausts its retries, a later message with the same key can still be
// written, overtaking it. So messages are sent in rounds: round r holds the
// r-th message of each ordering key (and every unkeyed message goes in the
// first), each round waits for its acknowledgements, and a key that failed
// sends nothing more: its remaining messages are reported failed, not
// sent. With one message per key, as when many aggregates are relayed, the
// whole batch is one round.
func (p *Publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return errors.New("kafka: publisher is closed")
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := p.awaitTopic(msgs[0].Context(), topic); err != nil {
		return err
	}
	rounds := orderingRounds(msgs)
	b := &batchState{topic: topic, msgs: msgs, failed: map[int]error{}, failedKeys: map[string]bool{}}
	ctx := msgs[0].Context()
	for r, round := range rounds {
		// SendMessages does not watch the context: between rounds is
		// where a batch whose bound passed (the outbox relay's lanes'
		// lease) stops, so that the rounds sent are reported sent and the
		// rest not sent, instead of the call outliving its bound whole.
		if err := ctx.Err(); err != nil {
			b.notSent(rounds[r:], err)
			break
		}
		p.sendRound(b, round)
	}
	if len(b.failed) == 0 {
		return nil
	}
	return &batch.Error{Failed: b.failed}
}

// orderingRounds splits msgs (by index) into PublishBatch's rounds: round
// r holds the r-th message of each ordering key, in order, and every
// unkeyed message goes in the first.
func orderingRounds(msgs []*message.Message) [][]int {
	var rounds [][]int
	nth := map[string]int{}
	for i, msg := range msgs {
		r := 0
		if k := msg.Metadata.Get(metadata.OrderingKey); k != "" {
			r = nth[k]
			nth[k]++
		}
		if r == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[r] = append(rounds[r], i)
	}
	return rounds
}

// batchState is one PublishBatch's bookkeeping: the messages that failed
// (by index, with why) and the ordering keys that may send nothing more.
type batchState struct {
	topic      string
	msgs       []*message.Message
	failed     map[int]error
	failedKeys map[string]bool
}

// fail records message i's failure and stops its ordering key.
func (b *batchState) fail(i int, err error) {
	b.failed[i] = err
	if k := b.msgs[i].Metadata.Get(metadata.OrderingKey); k != "" {
		b.failedKeys[k] = true
	}
}

// notSent records the messages of rounds not yet failed as not sent
// because the batch's context ended with err.
func (b *batchState) notSent(rounds [][]int, err error) {
	for _, rest := range rounds {
		for _, i := range rest {
			if _, ok := b.failed[i]; !ok {
				b.failed[i] = fmt.Errorf("kafka: message %s not sent: the batch's context ended first: %w", b.msgs[i].UUID, err)
			}
		}
	}
}

// sendRound marshals the round's messages whose key has not failed, sends
// them in one SendMessages call and records what failed.
func (p *Publisher) sendRound(b *batchState, round []int) {
	kms := make([]*sarama.ProducerMessage, 0, len(round))
	index := make(map[*sarama.ProducerMessage]int, len(round))
	for _, i := range round {
		msg := b.msgs[i]
		if k := msg.Metadata.Get(metadata.OrderingKey); k != "" && b.failedKeys[k] {
			b.failed[i] = fmt.Errorf("kafka: message %s not sent: an earlier message with ordering key %q failed", msg.UUID, k)
			continue
		}
		km, err := p.marshaler.Marshal(b.topic, msg)
		if err != nil {
			b.fail(i, fmt.Errorf("kafka: marshaling message %s: %w", msg.UUID, err))
			continue
		}
		kms = append(kms, km)
		index[km] = i
	}
	if len(kms) == 0 {
		return
	}
	err := p.producer.SendMessages(kms)
	if err == nil {
		return
	}
	var perrs sarama.ProducerErrors
	if !errors.As(err, &perrs) {
		// Nothing is known of this round: all of it failed.
		for _, km := range kms {
			i := index[km]
			b.fail(i, fmt.Errorf("kafka: publishing message %s to %s: %w", b.msgs[i].UUID, b.topic, err))
		}
		return
	}
	for _, pe := range perrs {
		if i, ok := index[pe.Msg]; ok {
			b.fail(i, fmt.Errorf("kafka: publishing message %s to %s: %w", b.msgs[i].UUID, b.topic, p.classify(pe.Msg, pe.Err)))
		}
	}
}

// Close closes the producer. It is idempotent.
func (p *Publisher) Close() error {
	var err error
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		err = errors.Join(p.producer.Close(), p.client.Close())
	})
	return err
}

// awaitTopic returns once every partition of topic has a leader, the first
// time the publisher sees the topic. A topic that does not exist yet is
// created by the metadata request when the cluster auto-creates topics,
// and for a moment has partitions without a leader. Sending then would
// fail each message with "unknown topic or partition", and three such
// failures in a row open Sarama's per-topic circuit breaker for 10 s; a
// real broker takes that moment, kfake does not.
func (p *Publisher) awaitTopic(ctx context.Context, topic string) error {
	if _, ok := p.ready.Load(topic); ok {
		return nil
	}
	deadline := time.Now().Add(p.topicWait)
	pause := 20 * time.Millisecond
	for {
		parts, err := p.client.Partitions(topic) // fetches metadata when unknown
		if err == nil && len(parts) > 0 {
			writable, werr := p.client.WritablePartitions(topic)
			if werr == nil && len(writable) == len(parts) {
				if _, seen := p.ready.LoadOrStore(topic, struct{}{}); !seen {
					p.checkReplication(topic)
				}
				return nil
			}
			err = fmt.Errorf("%d of %d partitions have a leader", len(writable), len(parts))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kafka: topic %s is not writable after %s: %w (create it, or enable auto.create.topics.enable on the brokers)", topic, p.topicWait, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafka: waiting for topic %s to be writable: %w", topic, ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 500*time.Millisecond)
		_ = p.client.RefreshMetadata(topic)
	}
}

// scramClient adapts xdg-go/scram to sarama.SCRAMClient.
type scramClient struct {
	hash scram.HashGeneratorFcn
	conv *scram.ClientConversation
}

func (s *scramClient) Begin(user, password, authzID string) error {
	c, err := s.hash.NewClient(user, password, authzID)
	if err != nil {
		return err
	}
	s.conv = c.NewConversation()
	return nil
}

func (s *scramClient) Step(challenge string) (string, error) { return s.conv.Step(challenge) }
func (s *scramClient) Done() bool                            { return s.conv.Done() }
