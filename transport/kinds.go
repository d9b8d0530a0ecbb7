package transport

import (
	"context"
	"crypto/tls"
	"database/sql"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
)

// Backend is one open transport of a kind: what a Driver's Open returns
// and Transport wraps.
type Backend interface {
	Publisher() message.Publisher
	Subscriber(group string) (message.Subscriber, error)
	Close() error
}

// Driver opens one kind. Each kind's sub-package registers its Driver in
// an init function, as database/sql drivers do, so a program links only
// the kinds it imports:
//
//	import _ "github.com/millwright/millwright/transport/kafka" // one kind
//	import _ "github.com/millwright/millwright/transport/all"   // all five
type Driver struct {
	// Validate reports configuration of the kind that cannot work
	// (cfg.Kind is the driver's kind), naming the field and the fix.
	Validate func(cfg Config) error
	// Open connects (cfg has passed Validate).
	Open func(ctx context.Context, cfg Config) (Backend, error)
	// Limits, if set, adjusts the kind's DefaultLimits (def) to cfg, for
	// LimitsFor: settings that raise or lower the largest message.
	Limits func(cfg Config, def Limits) Limits
	// Settings are how ParseURL, FromEnv, Config.Setting and Config.String
	// read and describe the kind's configuration.
	Settings Settings
}

var (
	driversMu sync.RWMutex
	drivers   = map[Kind]Driver{}
)

// Register makes a kind available to Open, ParseURL and FromEnv. The kind
// sub-packages call it from init; it panics if kind is registered twice or
// the driver lacks Validate or Open, as database/sql.Register does.
func Register(kind Kind, d Driver) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if d.Validate == nil || d.Open == nil {
		panic("transport: Register " + string(kind) + ": driver without Validate or Open")
	}
	if _, dup := drivers[kind]; dup {
		panic("transport: Register called twice for kind " + string(kind))
	}
	registerSettings(kind, d.Settings)
	drivers[kind] = d
}

// Registered lists the kinds this program links, sorted.
func Registered() []Kind {
	driversMu.RLock()
	defer driversMu.RUnlock()
	out := make([]Kind, 0, len(drivers))
	for k := range drivers {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// driverPackages are the sub-packages that register each kind.
var driverPackages = map[Kind]string{
	Kafka: "kafka", AMQP: "amqp", GoogleCloud: "googlecloud", SQL: "sql", GoChannel: "gochannel", NATS: "nats",
}

// driver returns kind's registered Driver, or an error naming the import
// that registers it.
func driver(kind Kind) (Driver, error) {
	driversMu.RLock()
	d, ok := drivers[kind]
	driversMu.RUnlock()
	if !ok {
		return d, fmt.Errorf("transport: kind %s is not linked into this program: add import _ \"github.com/millwright/millwright/transport/%s\" (or _ \"github.com/millwright/millwright/transport/all\" for every kind)", kind, driverPackages[kind])
	}
	return d, nil
}

// validateKind validates the settings of one kind through its driver.
func validateKind(kind Kind, c Config) error {
	d, err := driver(kind)
	if err != nil {
		return err
	}
	c.Kind = kind
	return d.Validate(c)
}

// Validate reports Kafka settings that cannot work (through the kafka
// driver, which must be linked: see Driver).
func (c KafkaConfig) Validate() error { return validateKind(Kafka, Config{Kafka: c}) }

// Validate reports RabbitMQ settings that cannot work.
func (c AMQPConfig) Validate() error { return validateKind(AMQP, Config{AMQP: c}) }

// Validate reports Pub/Sub settings that cannot work.
func (c GoogleCloudConfig) Validate() error { return validateKind(GoogleCloud, Config{GoogleCloud: c}) }

// Validate reports Postgres transport settings that cannot work.
func (c SQLConfig) Validate() error { return validateKind(SQL, Config{SQL: c}) }

// Validate reports in-process transport settings that cannot work.
func (c GoChannelConfig) Validate() error { return validateKind(GoChannel, Config{GoChannel: c}) }

// Validate reports NATS JetStream settings that cannot work.
func (c NATSConfig) Validate() error { return validateKind(NATS, Config{NATS: c}) }

// KafkaConfig selects and tunes the Kafka cluster.
type KafkaConfig struct {
	// Brokers lists bootstrap broker addresses (host:port). Required.
	Brokers []string
	// ClientID identifies this client to the brokers. Default "millwright".
	ClientID string
	// TLS enables TLS with this configuration. Default nil: plaintext.
	TLS *tls.Config
	// SASL authenticates the client. Default: none.
	SASL KafkaSASL
	// InitialOffset is where a new consumer group starts: "oldest" (default,
	// so events published before the group first joined are not skipped) or
	// "newest".
	InitialOffset string
	// Partitions is the partition count of topics the subscriber creates
	// (SubscribeInitialize). Default 8. Production topics are best created
	// by their owners with the partition count they need.
	Partitions int32
	// ReplicationFactor of topics the subscriber creates. Default 1.
	ReplicationFactor int16
	// ConnectTimeout bounds Open's first contact with the cluster. Default 10s.
	ConnectTimeout time.Duration
	// Partitioner places messages that have an ordering key: "murmur2"
	// (default) is the Java client's and franz-go's formula,
	// toPositive(murmur2(key)) % partitions, so a key lands on the same
	// partition whichever client produced it; "fnv1a" is Sarama's hash
	// partitioner, which millwright used before: keep it for a topic whose
	// keys it already placed, since switching moves most keys to another
	// partition and their order across the switch is lost. Messages without
	// a key go to a random partition either way.
	Partitioner string
	// Version is the Kafka protocol version Sarama speaks, as "3.6.0": it
	// picks the version of every request. Default DefaultVersion (3.6.0,
	// Sarama's highest; transport/embedded sets KfakeVersion for kfake).
	// Valid: from 0.11.0.0 (message headers carry the metadata) to the
	// broker's own version; a broker older than 3.6 needs its own. Kafka
	// 4.x supports clients from 2.1 on (KIP-896).
	Version string
	// KeyParallelism, above 0, makes consumer-group subscribers
	// millwright's key-parallel consumer (kafka.KeyedSubscriber): within
	// one partition, messages of different Kafka keys (the ordering key,
	// i.e. the aggregate) are handled concurrently, up to this many at
	// once; one key's messages stay in order, one at a time; offsets are
	// committed only up to the oldest unfinished message. Default 0:
	// watermill-kafka's subscriber, one message per partition at a time.
	// Env MILLWRIGHT_KAFKA_KEY_PARALLELISM.
	KeyParallelism int
	// KeyMaxInFlight bounds, per partition, the messages the key-parallel
	// consumer has fetched and not finished (memory, and how far a
	// failing key's partition reads ahead before the fetch stops).
	// Default 16 × KeyParallelism; at least KeyParallelism. Env
	// MILLWRIGHT_KAFKA_KEY_MAX_IN_FLIGHT.
	KeyMaxInFlight int
	// KeyDrainTimeout bounds how long the key-parallel consumer waits for
	// a revoked partition's running handlers, at a rebalance or Close,
	// before it cancels their messages' contexts and hands the partition
	// on (its next owner gets them again). The group's rebalance timeout
	// (Sarama's Consumer.Group.Rebalance.Timeout) is raised to 4/3 of it
	// so that the member waiting stays in the group: a rebalance then
	// lasts as long as the slowest running handler, up to this bound (a
	// member that died is still dropped at its session timeout, 10 s).
	// Default 30s (Watermill's Router CloseTimeout); a Tune that lowers
	// the rebalance timeout lowers the bound to 3/4 of it.
	KeyDrainTimeout time.Duration
	// Tune, if set, adjusts the Sarama configuration last (escape hatch).
	// It must be a func(*sarama.Config) (github.com/IBM/sarama): it is
	// typed any so that package transport does not link Sarama into
	// programs that do not use Kafka; Validate refuses any other type.
	Tune any
	// Fake, a DEVELOPMENT FAKE NOT FOR PRODUCTION, makes Open start an
	// in-process Kafka (franz-go's kfake: one broker, topics created on
	// first use, everything in memory and lost on Close, no
	// authentication) and connect to it; Close stops it. Brokers must then
	// be empty. Selected by MILLWRIGHT_TRANSPORT=kfake or kfake://.
	// Default false.
	Fake bool
}

// KafkaSASL holds SASL credentials.
type KafkaSASL struct {
	// Mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; empty disables SASL.
	Mechanism string
	User      string
	Password  string
}

// AMQPConfig selects and tunes the RabbitMQ connection.
type AMQPConfig struct {
	// URL is amqp://user:pass@host:5672/vhost or amqps://... Required.
	URL string
	// TLS configures amqps. Default nil: the system roots when the URL is
	// amqps://, plaintext for amqp://.
	TLS *tls.Config
	// Prefetch is how many unacked messages a consumer holds (the
	// channel's QoS). Default 100, or 16 × KeyParallelism when that is
	// larger; 1 gives strict ordering with one consumer. With
	// KeyParallelism it is the key-parallel consumer's cap on deliveries
	// in flight (memory) and must be at least KeyParallelism.
	Prefetch int
	// KeyParallelism, above 0, makes subscribers millwright's
	// key-parallel consumer (amqp.KeyedSubscriber): messages of different
	// ordering keys (metadata.OrderingKey, the aggregate) are handled
	// concurrently, up to this many at once per subscription; one key's
	// messages stay in queue order, one at a time; a nacked message runs
	// again in its key's place instead of being requeued; each delivery
	// is acked only after its handler finished. Default 0:
	// watermill-amqp's subscriber, which hands out one delivery at a time
	// and waits for its ack. Env MILLWRIGHT_AMQP_KEY_PARALLELISM.
	KeyParallelism int
	// KeyDrainTimeout bounds how long the key-parallel consumer's Close
	// (and a subscription's end) waits for handlers still running to
	// finish and be acked; those still running after it have their
	// message's context cancelled, and RabbitMQ redelivers their
	// messages. Default 30s (Watermill's Router CloseTimeout).
	KeyDrainTimeout time.Duration
	// ChannelPoolSize is the number of publishing channels. Default 8.
	ChannelPoolSize int
	// NoConfirm turns off publisher confirms (faster; a publish may then be
	// lost if the broker dies right after it). Default false: confirms on.
	// It requires AllowUnroutable: without confirms nothing tells when
	// the broker's return of an unroutable message would have arrived.
	NoConfirm bool
	// AllowUnroutable publishes without the mandatory flag: a message that
	// no queue is bound to receive is dropped by RabbitMQ, as plain AMQP
	// does, and Publish still returns nil. Default false: every message is
	// published mandatory, and one the broker returns because no queue is
	// bound to the topic's exchange fails the publish with ErrUnroutable,
	// naming the exchange, so the outbox relay keeps the row and the DLQ
	// middleware nacks the original until a queue exists (subscribe the
	// group first, or list it in DeclareGroups). Env
	// MILLWRIGHT_AMQP_ALLOW_UNROUTABLE.
	AllowUnroutable bool
	// DeclareGroups lists consumer groups whose queues the publisher
	// declares and binds before its first publish to a topic, so no message
	// is dropped before their subscribers start. Default none.
	DeclareGroups []string
	// ConnectTimeout bounds Open's connection attempt and each of the
	// publisher's reconnect attempts, a publish's wait for a free channel,
	// and Close's wait for the publishes in flight. Default 10s.
	ConnectTimeout time.Duration
}

// GoogleCloudConfig selects and tunes the Pub/Sub project.
type GoogleCloudConfig struct {
	// ProjectID is the Google Cloud project. Required.
	ProjectID string
	// EmulatorHost, if set (host:port), reaches a Pub/Sub emulator without
	// credentials. The client also honours PUBSUB_EMULATOR_HOST.
	EmulatorHost string
	// CredentialsFile is a service-account JSON key file. Default: the
	// application default credentials.
	CredentialsFile string
	// ClientOptions are passed to the Pub/Sub client last (escape hatch).
	// Each must be a google.golang.org/api/option.ClientOption: they are
	// typed any so that package transport does not link the Google client
	// into programs that do not use Pub/Sub; Validate refuses other types.
	ClientOptions []any
	// PublishTimeout bounds one Publish call. Default 30s.
	PublishTimeout time.Duration
	// PublishDelay is the client's batching delay. Default 1ms (the
	// library's 10ms makes every synchronous publish wait 10ms).
	PublishDelay time.Duration
	// MaxExtension is the longest lease the subscriber asks for at a time
	// (the client's ReceiveSettings.MaxExtensionPeriod): while a handler
	// runs, its message's lease is renewed in steps of at most this long
	// (for up to the client's MaxExtension, an hour), so a subscriber
	// that stops or dies holding messages leaves them leased for at most
	// this long after its last renewal, and Pub/Sub then redelivers them
	// (an ordering key's unacked message and every later one, in order).
	// It is also the stream's ack deadline, the lease the emulator gives
	// what it streams to a consumer that died. Default 1 minute
	// (googlecloud.DefaultMaxExtension); 10s on the emulator and the fake
	// (googlecloud.EmulatorMaxExtension). See googlecloud.RedeliveryBound.
	MaxExtension time.Duration
	// MaxOutstandingMessages bounds the messages a subscriber holds
	// unacked (the client's ReceiveSettings.MaxOutstandingMessages): with
	// the message ordering millwright's subscriptions enable, Google's
	// client runs one handler at a time per ordering key and different
	// keys concurrently, so this is how many keys are handled at once.
	// Default 0: the client's default, 1,000; negative: no limit.
	MaxOutstandingMessages int
	// DeclareGroups lists consumer groups whose subscriptions the
	// publisher creates before its first publish to a topic, so messages
	// published before their subscribers start are kept. Default none.
	DeclareGroups []string
	// ConnectTimeout bounds Open's first contact. Default 10s.
	ConnectTimeout time.Duration
	// AllowUnreceived publishes to a topic without checking that it has
	// a subscription: Pub/Sub then accepts, and keeps for nobody, a
	// message no subscription would receive. Default false: until a
	// topic is seen to have a subscription (one ListTopicSubscriptions
	// call per publish, which needs pubsub.topics.listSubscriptions),
	// a publish to it fails with ErrNoSubscription. Env
	// MILLWRIGHT_PUBSUB_ALLOW_UNRECEIVED.
	AllowUnreceived bool
	// Registerer receives the googlecloud Metric* gauges (outstanding
	// messages, last delivery and stall per subscription). Default nil:
	// none registered. Transports sharing a Registerer share them.
	Registerer prometheus.Registerer
	// Fake, a DEVELOPMENT FAKE NOT FOR PRODUCTION, makes Open start an
	// in-process Pub/Sub (the Google client's pstest: in memory, lost on
	// Close, no authentication, about 800 msg/s at most, one message per
	// ordering key at a time) and connect to it; Close stops it.
	// EmulatorHost must then be empty; ProjectID defaults to
	// FakeProjectID and MaxExtension to 10s. Selected by
	// MILLWRIGHT_TRANSPORT=pstest or pstest://[PROJECT]. Default false.
	Fake bool
}

// SQLConfig selects and tunes the Postgres transport.
type SQLConfig struct {
	// URL is postgres://user:pass@host:5432/db?sslmode=... Required unless DB is set.
	URL string
	// DB, if set, is used instead of opening URL (share the service's pool).
	// Close does not close it.
	DB *sql.DB
	// MaxOpenConns bounds the pool opened from URL. Default 10.
	MaxOpenConns int
	// PollInterval is how often an idle subscriber polls when no
	// notification wakes it first: the fallback for a notification lost
	// (the LISTEN connection down) or a subscriber without one (DB set and
	// ListenURL empty). Default 100ms.
	PollInterval time.Duration
	// ListenURL is where the subscribers' LISTEN connection (one per
	// transport) connects: each messages table's trigger NOTIFYs at the
	// commit of every insert, and the subscriber of that table queries at
	// once instead of waiting for its poll. Default URL; with DB set and
	// ListenURL empty the subscribers only poll. "-" disables the wake-up.
	ListenURL string
	// ResendInterval is how long a nacked message waits before it is
	// delivered again. Default 1s (watermill-sql's).
	ResendInterval time.Duration
	// ConnectTimeout bounds Open's first ping and, when URL sets no
	// connect_timeout (and PGCONNECT_TIMEOUT is unset), every connection
	// attempt of the pool opened from URL (rounded up to whole seconds).
	// Default 10s.
	ConnectTimeout time.Duration
	// HorizonCheckInterval is how often, once the transport has a
	// subscriber, it reads the server's xmin horizon (see Horizon), sets
	// MetricHorizonAge and MetricHorizonPID, and counts the subscribed
	// topics' rows waiting behind a holder older than HorizonWarnAge.
	// Default 10s; -1 disables the check.
	HorizonCheckInterval time.Duration
	// HorizonWarnAge is how long the horizon's holder must have been open
	// before committed rows waiting behind it are logged (as an error,
	// naming the holder's pid and the fix; again every minute while they
	// wait, and once when they no longer do). Default 30s.
	HorizonWarnAge time.Duration
	// WakeCheckInterval is how often the subscribers' wake-up
	// connections (on ListenURL) are checked: the LISTEN connection
	// answers a ping (after this long without a notification), and the
	// wake-up lock's session, while it holds a lock, shows that it still
	// does; each check must answer within WakeCheckInterval. A connection
	// the server ended (idle_session_timeout, pg_terminate_backend, a
	// proxy or pooler dropping it) or that went silent is replaced, the
	// locks are taken again, and every waiting subscription queries once:
	// a committed row then waits at most about 2 x WakeCheckInterval
	// (plus a reconnection), or PollInterval if that is shorter. Default
	// 5s; at least 10ms; -1 disables the checks (a lost connection then
	// costs up to PollInterval per wait).
	WakeCheckInterval time.Duration
	// Registerer receives MetricHorizonAge and MetricHorizonPID. Default
	// nil: none registered. Transports sharing a Registerer share them.
	Registerer prometheus.Registerer
}

// GoChannelConfig tunes the in-process transport.
type GoChannelConfig struct {
	// Buffer is each subscriber's output channel size. Default 1024.
	Buffer int64
	// NotPersistent drops messages published while no subscriber listens
	// and keeps none in memory. Default false: persistent.
	NotPersistent bool
}

// NATSConfig selects and tunes the NATS JetStream connection (package
// transport/nats explains the streams and consumers it creates).
type NATSConfig struct {
	// URL is nats://host:4222 (several servers comma-separated:
	// nats://h1:4222,nats://h2:4222; user:pass@ or a token in the URL
	// authenticate). Required. MILLWRIGHT_TRANSPORT takes nats:// URLs;
	// a tls://host:4222 server URL goes in MILLWRIGHT_NATS_URL (with
	// MILLWRIGHT_TRANSPORT=nats) or here.
	URL string
	// TLS configures TLS. Default nil: plaintext for nats://, the system
	// roots for tls:// server URLs.
	TLS *tls.Config
	// Replicas of the streams the transport creates. Default 1; at most 5
	// (a JetStream cluster's limit), and at most the cluster's size.
	Replicas int
	// MaxAge bounds how long a stream the transport creates keeps a
	// message (JetStream's limits retention: messages stay after every
	// consumer acked them, so that a new consumer group starts at the
	// oldest). Default 7 days; -1: forever.
	MaxAge time.Duration
	// DuplicateWindow is how long the stream remembers a message's
	// Nats-Msg-Id (the outbox event id, or the message UUID): a message
	// published again within it (the relay after a lost acknowledgement)
	// is acknowledged and dropped by the server. Default 2 minutes
	// (JetStream's); at most MaxAge.
	DuplicateWindow time.Duration
	// AckWait is how long the server waits for a delivered message's
	// acknowledgement before it delivers it again. While a handler runs,
	// the subscriber tells the server it is still in progress every
	// AckWait/3, so a slow handler is not overtaken by its own redelivery;
	// AckWait thus bounds how long a consumer that died holds its
	// messages. Default 30s; at least 1s.
	AckWait time.Duration
	// MaxAckPending bounds the messages a consumer group holds delivered
	// and unacknowledged (over all its members). Default 1,000, or 16 ×
	// KeyParallelism when that is larger; at least KeyParallelism.
	MaxAckPending int
	// MaxDeliver is how many times the server delivers a message before it
	// gives up on it. Default -1: no limit, so a message that keeps
	// failing is never dropped by the server; millwright's retry, park and
	// dlq middlewares end its attempts, with a dead letter. A positive
	// value makes the subscriber hand the last delivery's failure to the
	// dead letter topic DeadLetterTopic instead of letting the server drop
	// it; it requires DeadLetterTopic.
	MaxDeliver int
	// DeadLetterTopic receives, with MaxDeliver set, a message whose
	// handler failed at its last delivery: the message, its metadata, and
	// the dlq metadata naming the topic, the group, the deliveries and the
	// error. Default "": none (MaxDeliver must then be -1).
	DeadLetterTopic string
	// KeyParallelism, above 0, makes subscribers millwright's
	// key-parallel consumer (nats.KeyedSubscriber): messages of different
	// ordering keys (metadata.OrderingKey, the aggregate) are handled
	// concurrently, up to this many at once per subscription; one key's
	// messages stay in stream order, one at a time; a nacked message runs
	// again in its key's place instead of being redelivered behind its
	// key's later ones; each message is acknowledged only after its
	// handler finished. Default 0: one message at a time per subscription.
	// Env MILLWRIGHT_NATS_KEY_PARALLELISM.
	KeyParallelism int
	// KeyDrainTimeout bounds how long a subscription's end (Close, or its
	// context) waits for handlers still running; the rest have their
	// message's context cancelled and the server delivers them again after
	// AckWait. Default 30s (Watermill's Router CloseTimeout).
	KeyDrainTimeout time.Duration
	// MaxPayload is the largest message (payload plus headers) the
	// server takes: its max_payload. Default 1 MiB (nats-server's
	// default); Open reads the server's own and refuses a message over it.
	MaxPayload int
	// ConnectTimeout bounds Open's connection attempt and each JetStream
	// API call (creating a stream or consumer, a publish's
	// acknowledgement). Default 10s.
	ConnectTimeout time.Duration
	// Registerer receives the nats Metric* gauges (stream messages,
	// consumer pending and unacknowledged messages). Default nil: none
	// registered.
	Registerer prometheus.Registerer
}
