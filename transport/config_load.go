package transport

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/envparse"
)

// EnvPrefix is the prefix of every environment variable millwright reads.
const EnvPrefix = "MILLWRIGHT_"

// Environment variables read by FromEnv.
const (
	// EnvTransport selects the transport: a kind name (kafka, amqp,
	// googlecloud, sql, gochannel, nats), a development fake (kfake, pstest), or
	// a URL (see ParseURL).
	EnvTransport = EnvPrefix + "TRANSPORT"

	EnvKafkaBrokers       = EnvPrefix + "KAFKA_BROKERS"        // comma-separated host:port
	EnvKafkaTLS           = EnvPrefix + "KAFKA_TLS"            // true: TLS with system roots
	EnvKafkaTLSCAFile     = EnvPrefix + "KAFKA_TLS_CA_FILE"    // PEM CA bundle; implies TLS
	EnvKafkaSASLMechanism = EnvPrefix + "KAFKA_SASL_MECHANISM" // PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
	EnvKafkaSASLUser      = EnvPrefix + "KAFKA_SASL_USER"
	EnvKafkaSASLPassword  = EnvPrefix + "KAFKA_SASL_PASSWORD"
	EnvKafkaPartitions    = EnvPrefix + "KAFKA_PARTITIONS"  // partitions of topics the subscriber creates
	EnvKafkaPartitioner   = EnvPrefix + "KAFKA_PARTITIONER" // murmur2 (default, the Java client's) or fnv1a (Sarama's)
	// EnvKafkaKeyParallelism, above 0, turns on the key-parallel consumer
	// (kafka.Config.KeyParallelism); EnvKafkaKeyMaxInFlight bounds its
	// unfinished messages per partition (kafka.Config.KeyMaxInFlight).
	EnvKafkaKeyParallelism = EnvPrefix + "KAFKA_KEY_PARALLELISM"
	EnvKafkaKeyMaxInFlight = EnvPrefix + "KAFKA_KEY_MAX_IN_FLIGHT"

	EnvAMQPURL      = EnvPrefix + "AMQP_URL" // amqp://user:pass@host:5672/vhost or amqps://
	EnvAMQPPrefetch = EnvPrefix + "AMQP_PREFETCH"
	// EnvAMQPKeyParallelism, above 0, turns on the key-parallel consumer
	// (amqp.Config.KeyParallelism); its cap on deliveries in flight is
	// EnvAMQPPrefetch.
	EnvAMQPKeyParallelism = EnvPrefix + "AMQP_KEY_PARALLELISM"
	// EnvAMQPAllowUnroutable, true, lets RabbitMQ drop a message no queue
	// is bound for instead of failing its publish (amqp.Config.AllowUnroutable).
	EnvAMQPAllowUnroutable = EnvPrefix + "AMQP_ALLOW_UNROUTABLE"

	EnvPubSubProject         = EnvPrefix + "PUBSUB_PROJECT"
	EnvPubSubEmulatorHost    = EnvPrefix + "PUBSUB_EMULATOR_HOST"
	EnvPubSubCredentialsFile = EnvPrefix + "PUBSUB_CREDENTIALS_FILE"
	// EnvPubSubAllowUnreceived, true, publishes to a topic without checking
	// that it has a subscription (googlecloud.Config.AllowUnreceived).
	EnvPubSubAllowUnreceived = EnvPrefix + "PUBSUB_ALLOW_UNRECEIVED"

	EnvSQLURL      = EnvPrefix + "SQL_URL"      // postgres://...; falls back to EnvDatabaseURL
	EnvDatabaseURL = EnvPrefix + "DATABASE_URL" // the service's own database
	// EnvSQLListenURL is where the sql subscribers' LISTEN connection goes
	// (SQLConfig.ListenURL; "-" turns the NOTIFY wake-up off).
	EnvSQLListenURL = EnvPrefix + "SQL_LISTEN_URL"

	EnvNATSURL = EnvPrefix + "NATS_URL" // nats://host:4222 (comma-separated for several servers)
	// EnvNATSKeyParallelism, above 0, turns on the key-parallel consumer
	// (nats.Config.KeyParallelism).
	EnvNATSKeyParallelism = EnvPrefix + "NATS_KEY_PARALLELISM"
	// EnvNATSAckWait is the consumers' AckWait (nats.Config.AckWait): a
	// duration such as 30s.
	EnvNATSAckWait = EnvPrefix + "NATS_ACK_WAIT"

	// EnvDeclareGroups lists consumer groups (comma-separated) whose AMQP
	// queues or Pub/Sub subscriptions the publisher creates up front.
	EnvDeclareGroups = EnvPrefix + "DECLARE_GROUPS"

	// EnvWaitForBroker bounds how long Open waits for a broker it cannot
	// reach (Config.WaitForBroker): a duration (2m), forever (default)
	// or off.
	EnvWaitForBroker = EnvPrefix + "WAIT_FOR_BROKER"
)

// FromEnv builds a Config from the MILLWRIGHT_ environment variables.
// MILLWRIGHT_TRANSPORT selects the kind, by name or by URL; the per-kind
// variables (read by every linked kind's Settings.FromEnv) fill in or
// override the rest.
func FromEnv() (Config, error) { return fromLookup(os.LookupEnv) }

func fromLookup(lookup func(string) (string, bool)) (Config, error) {
	env := Env{lookup: lookup}
	cfg, err := selectKind(env.Get(EnvTransport))
	if err != nil {
		return cfg, err
	}
	env.cfg = &cfg
	var errs []error
	for _, s := range linkedSettings() {
		if s.FromEnv != nil {
			errs = append(errs, s.FromEnv(&cfg, env))
		}
	}
	if v := env.Get(EnvWaitForBroker); v != "" {
		d, err := parseWait(v)
		errs = append(errs, err)
		cfg.WaitForBroker = d
	}
	if err := errors.Join(errs...); err != nil {
		return cfg, err
	}
	cfg.sealSources(nil)
	return cfg, cfg.Validate()
}

// selectKind reads MILLWRIGHT_TRANSPORT: a URL, a development fake or a
// kind name.
func selectKind(sel string) (Config, error) {
	var cfg Config
	if sel == "" {
		return cfg, fmt.Errorf("%w: set %s to one of %s, or to a URL such as kafka://host:9092", errNoKind, EnvTransport, kindList())
	}
	if strings.Contains(sel, "://") {
		c, err := ParseURL(sel)
		if err != nil {
			return cfg, fmt.Errorf("%s: %w", EnvTransport, err)
		}
		c.sealSources(map[string]string{SourceURL: EnvTransport})
		return c, nil
	}
	name := strings.ToLower(sel)
	if sc, _, ok, _ := lookupScheme(name); ok && (sc.fake != nil || isFakeName(name)) {
		cfg.Kind = sc.kind // an unlinked kind's fake fails Validate, naming the import
		if sc.fake != nil {
			sc.fake.Select(&cfg)
		}
		return cfg, nil
	}
	cfg.Kind = Kind(name)
	if !isKind(cfg.Kind) {
		_, fakes := schemeList("")
		return cfg, fmt.Errorf("%s: invalid transport %q: want one of %s%s", EnvTransport, sel, kindList(), orFakes(fakes))
	}
	return cfg, nil
}

// isFakeName reports whether name is a built-in development fake.
func isFakeName(name string) bool { return name == FakeKafka || name == FakePubSub }

// orFakes is the tail of an error listing the development fakes, if any.
func orFakes(fakes string) string {
	if fakes == "" {
		return ""
	}
	return ", or a development fake: " + fakes
}

// parseWait parses MILLWRIGHT_WAIT_FOR_BROKER.
func parseWait(v string) (time.Duration, error) {
	switch strings.ToLower(v) {
	case "forever":
		return 0, nil
	case "off", "0":
		return NoWait, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive duration such as 2m, forever (the default: until the start context ends) or off (fail at the first attempt)", EnvWaitForBroker, v)
	}
	return d, nil
}

// isScheme reports whether s is a URL scheme as RFC 3986 spells it: a
// letter, then letters, digits, '+', '-' or '.'.
func isScheme(s string) bool {
	for i, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
		case i > 0 && (r >= '0' && r <= '9' || r == '+' || r == '-' || r == '.'):
		default:
			return false
		}
	}
	return s != ""
}

// isKind reports whether k is a built-in kind (linked or not: Validate
// then names the import) or a registered one.
func isKind(k Kind) bool {
	if kindOrder(k) < len(Kinds) {
		return true
	}
	driversMu.RLock()
	defer driversMu.RUnlock()
	_, ok := drivers[k]
	return ok
}

// ParseURL builds a Config from a URL:
//
//	kafka://h1:9092,h2:9092                 Kafka bootstrap brokers
//	kafka://user:pass@h1:9093?sasl=SCRAM-SHA-512&tls=true
//	kafka://h1:9092?partitioner=fnv1a       ... placing keys as Sarama's hash partitioner
//	amqp://user:pass@host:5672/vhost         RabbitMQ (amqps:// for TLS)
//	gcppubsub://PROJECT                      Google Cloud Pub/Sub
//	gcppubsub://PROJECT?emulator=host:8085   ... through an emulator
//	postgres://user:pass@host:5432/db        Postgres (watermill-sql)
//	mem://                                   in-process (gochannel)
//	nats://host:4222                         NATS JetStream (TLS: NATSConfig.TLS, or tls:// in MILLWRIGHT_NATS_URL)
//	kfake://                                 DEVELOPMENT FAKE: in-process Kafka (kafka.Config.Fake)
//	pstest://[PROJECT]                       DEVELOPMENT FAKE: in-process Pub/Sub (googlecloud.Config.Fake)
//
// The two fakes keep everything in memory and lose it on Close; they are
// for trying millwright and for tests, never for production.
//
// Errors never include the password.
func ParseURL(raw string) (Config, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok || !isScheme(scheme) {
		return Config{}, errNoScheme()
	}
	sc, s, ok, err := lookupScheme(strings.ToLower(scheme))
	switch {
	case !ok:
		listed, fakes := schemeList("")
		return Config{}, fmt.Errorf("transport: unknown URL scheme %q: want %s%s", envparse.Short(scheme), listed, orFakes(fakes))
	case err != nil:
		return Config{Kind: sc.kind}, err
	}
	cfg := Config{Kind: sc.kind}
	if err := s.ParseURL(&cfg, URL{Raw: raw, Scheme: strings.ToLower(scheme), Rest: rest}); err != nil {
		return Config{}, err
	}
	for f := range s.Fields {
		cfg.setSource(f, SourceURL)
	}
	cfg.sealSources(nil)
	return cfg, cfg.Validate()
}
