package transport

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
)

// Kind names a transport.
type Kind string

// The transport kinds.
const (
	Kafka       Kind = "kafka"
	AMQP        Kind = "amqp"
	GoogleCloud Kind = "googlecloud"
	SQL         Kind = "sql"
	GoChannel   Kind = "gochannel"
	NATS        Kind = "nats"
)

// The development fakes: names MILLWRIGHT_TRANSPORT accepts, and URL
// schemes (kfake://, pstest://PROJECT), that select an in-process broker
// started by Open and stopped by Close (kafka.Config.Fake,
// googlecloud.Config.Fake). NOT FOR PRODUCTION: they keep everything in
// memory, authenticate nobody, and their timing differs from the real
// services. They let a new application run every kind by environment
// alone, without a broker.
const (
	FakeKafka  = "kfake"
	FakePubSub = "pstest"
)

// Kinds lists every kind, in documentation order.
var Kinds = []Kind{Kafka, AMQP, GoogleCloud, SQL, GoChannel, NATS}

// OrderingKey is the metadata key whose value keeps messages in order
// (metadata.OrderingKey, repeated here for discoverability).
const OrderingKey = metadata.OrderingKey

// Config selects a transport kind and holds the settings of every kind;
// only the selected kind's settings are used.
type Config struct {
	// Kind selects the transport. Required.
	Kind Kind
	// Kafka settings, used when Kind is kafka (kafka.Config is this type).
	Kafka KafkaConfig
	// AMQP settings, used when Kind is amqp (amqp.Config).
	AMQP AMQPConfig
	// GoogleCloud settings, used when Kind is googlecloud (googlecloud.Config).
	GoogleCloud GoogleCloudConfig
	// SQL settings, used when Kind is sql (sql.Config).
	SQL SQLConfig
	// GoChannel settings, used when Kind is gochannel (gochannel.Config).
	GoChannel GoChannelConfig
	// NATS settings, used when Kind is nats (nats.Config).
	NATS NATSConfig
	// Logger receives the transport's logs. Default: none.
	Logger watermill.LoggerAdapter `json:"-"`
	// WaitForBroker is how long Open keeps trying to reach a broker it
	// cannot reach (refused, unanswered, closed), so that a service
	// started while its broker is down or restarting waits for it
	// instead of exiting. Default 0: until Open's ctx ends (a service's
	// start context: its shutdown signal). A positive duration stops
	// waiting after that long; NoWait (-1) returns the first failure.
	// Between attempts Open backs off (0.5s doubling to 5s,
	// full jitter) and logs each failure at error level with what it
	// waits for, to Logger (to slog's default logger when Logger is nil:
	// a wait is never silent). Configuration errors (Validate), and those the broker
	// states for good (credentials refused, a listener that does not
	// speak the configured TLS or SASL, a database that does not
	// exist), are returned at once: waiting cannot fix them. Env
	// MILLWRIGHT_WAIT_FOR_BROKER: a duration, "forever" or "off".
	WaitForBroker time.Duration
	// OnWait, if set, is called after each failed attempt Open will
	// retry, with its error, as it is logged: for instance a
	// health.Waiter's Failed, so that readiness says "waiting for the
	// broker" meanwhile. It must not block. Default: none.
	OnWait func(err error) `json:"-"`

	// sources records where FromEnv and ParseURL took settings from,
	// for error messages (see Setting).
	sources map[string]source
}

// NoWait is the WaitForBroker value that makes Open return its first
// failure instead of waiting for the broker.
const NoWait time.Duration = -1

// Validate reports a configuration that cannot work, naming the field and
// the fix. It checks only the selected kind.
func (c Config) Validate() error {
	if c.WaitForBroker < NoWait {
		return fmt.Errorf("transport: WaitForBroker %s: want 0 (until Open's context ends), a positive duration, or NoWait (-1)", c.WaitForBroker)
	}
	switch {
	case c.Kind == "":
		return fmt.Errorf("transport: Kind is empty: want one of %s (env %s)", kindList(), EnvTransport)
	case !isKind(c.Kind):
		return fmt.Errorf("transport: invalid transport %q: want one of %s", string(c.Kind), kindList())
	}
	return validateKind(c.Kind, c)
}

// kindList lists Kinds, then any other registered kind.
func kindList() string {
	s := make([]string, 0, len(Kinds))
	for _, k := range Kinds {
		s = append(s, string(k))
	}
	for _, k := range Registered() {
		if kindOrder(k) == len(Kinds) {
			s = append(s, string(k))
		}
	}
	return strings.Join(s, ", ")
}

// String describes the configuration without secrets, for logs (through
// the kind's Settings.Describe).
func (c Config) String() string {
	if s, ok := describe(c); ok {
		return s
	}
	return fmt.Sprintf("transport %q", string(c.Kind))
}

// Transport is an open transport of one kind: a publisher shared by the
// application, subscribers per consumer group, and Close.
type Transport struct {
	kind   Kind
	desc   string
	b      Backend
	pub    message.Publisher
	names  *nameCache
	limits Limits
}

// Open validates cfg and connects to the broker. Each attempt is bounded
// by the kind's ConnectTimeout (default 10s); a broker it cannot reach is
// waited for, attempt after attempt, until ctx ends (Config.WaitForBroker
// bounds or disables the wait), each failure logged. Configuration errors
// and refusals that waiting cannot fix (bad credentials, a TLS or SASL
// listener mismatch) are returned at once. Errors name the setting each
// value came from (Config.Setting). The kind must be linked into the
// program (see Driver); Open says which import is missing.
func Open(ctx context.Context, cfg Config) (*Transport, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d, err := driver(cfg.Kind)
	if err != nil {
		return nil, err
	}
	b, err := openWaiting(ctx, cfg, d)
	if err != nil {
		return nil, err
	}
	names := &nameCache{kind: cfg.Kind}
	return &Transport{kind: cfg.Kind, desc: cfg.String(), b: b, pub: wrapPublisher(b.Publisher(), names), names: names, limits: LimitsFor(cfg)}, nil
}

// Kind returns the transport's kind.
func (t *Transport) Kind() Kind { return t.kind }

// String describes the transport without secrets.
func (t *Transport) String() string { return t.desc }

// Publisher returns the transport's publisher. It is safe for concurrent
// use; it implements BatchPublisher where the kind supports batches (kafka,
// amqp, sql).
// Do not close it: Close does, after the subscribers.
//
// Topics outside the allow-list (see ValidateName) are refused.
func (t *Transport) Publisher() message.Publisher { return t.pub }

// Subscriber returns a subscriber that belongs to consumer group `group`:
// every group receives every message of a topic, and the subscribers of one
// group share them. See the README's table for each kind's mapping.
//
// Group and topic names outside the allow-list (see ValidateName) are
// refused; group "" is allowed and means the kind's default.
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	if group != "" {
		if err := ValidateName(t.kind, "consumer group", group); err != nil {
			return nil, err
		}
	}
	sub, err := t.b.Subscriber(group)
	if err != nil {
		return nil, err
	}
	return wrapSubscriber(sub, t.names), nil
}

// Close closes every subscriber the transport made, then its publisher and
// connections. It is idempotent. Stop the router that uses them first, so
// handlers can drain (Watermill issue #446).
func (t *Transport) Close() error { return t.b.Close() }

var errNoKind = errors.New("transport: no transport configured")
