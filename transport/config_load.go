package transport

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/redact"
)

// EnvPrefix is the prefix of every environment variable millwright reads.
const EnvPrefix = "MILLWRIGHT_"

// Environment variables read by FromEnv.
const (
	// EnvTransport selects the transport: a kind name (kafka, amqp,
	// googlecloud, sql, gochannel), a development fake (kfake, pstest), or
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

	EnvAMQPURL      = EnvPrefix + "AMQP_URL" // amqp://user:pass@host:5672/vhost or amqps://
	EnvAMQPPrefetch = EnvPrefix + "AMQP_PREFETCH"
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
// variables fill in or override the rest.
func FromEnv() (Config, error) { return fromLookup(os.LookupEnv) }

func fromLookup(lookup func(string) (string, bool)) (Config, error) {
	get := func(k string) string { v, _ := lookup(k); return strings.TrimSpace(v) }
	var cfg Config
	sel := get(EnvTransport)
	switch {
	case sel == "":
		return cfg, fmt.Errorf("%w: set %s to one of %s, or to a URL such as kafka://host:9092", errNoKind, EnvTransport, kindList())
	case strings.Contains(sel, "://"):
		c, err := ParseURL(sel)
		if err != nil {
			return cfg, fmt.Errorf("%s: %w", EnvTransport, err)
		}
		cfg = c
		cfg.sealSources(map[string]string{SourceURL: EnvTransport})
	case strings.EqualFold(sel, FakeKafka):
		cfg.Kind, cfg.Kafka.Fake = Kafka, true
	case strings.EqualFold(sel, FakePubSub):
		cfg.Kind, cfg.GoogleCloud.Fake = GoogleCloud, true
	default:
		cfg.Kind = Kind(strings.ToLower(sel))
		if !isKind(cfg.Kind) {
			return cfg, fmt.Errorf("%s: invalid transport %q: want one of %s, or a development fake: %s, %s", EnvTransport, sel, kindList(), FakeKafka, FakePubSub)
		}
	}

	var errs []error
	if v := get(EnvKafkaBrokers); v != "" {
		cfg.Kafka.Brokers = splitList(v)
		cfg.setSource("Kafka.Brokers", EnvKafkaBrokers)
	}
	tlsOn, err := parseBool(EnvKafkaTLS, get(EnvKafkaTLS))
	errs = append(errs, err)
	if ca := get(EnvKafkaTLSCAFile); tlsOn || ca != "" {
		t, err := loadTLS(ca, false)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", EnvKafkaTLSCAFile, err))
		}
		cfg.Kafka.TLS = t
		if ca != "" {
			cfg.setSource("Kafka.TLS", EnvKafkaTLSCAFile)
		} else {
			cfg.setSource("Kafka.TLS", EnvKafkaTLS)
		}
	}
	if v := get(EnvKafkaSASLMechanism); v != "" {
		cfg.Kafka.SASL.Mechanism = strings.ToUpper(v)
		cfg.setSource("Kafka.SASL", EnvKafkaSASLMechanism)
	}
	if v := get(EnvKafkaSASLUser); v != "" {
		cfg.Kafka.SASL.User = v
	}
	if v, ok := lookup(EnvKafkaSASLPassword); ok {
		cfg.Kafka.SASL.Password = v
	}
	if v := get(EnvKafkaPartitions); v != "" {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("%s=%q: want a positive integer", EnvKafkaPartitions, v))
		}
		cfg.Kafka.Partitions = int32(n)
	}
	if v := get(EnvKafkaPartitioner); v != "" {
		cfg.Kafka.Partitioner = strings.ToLower(v)
	}

	if v := get(EnvAMQPURL); v != "" {
		cfg.AMQP.URL = v
		cfg.setSource("AMQP.URL", EnvAMQPURL)
	}
	if v := get(EnvAMQPPrefetch); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("%s=%q: want a positive integer", EnvAMQPPrefetch, v))
		}
		cfg.AMQP.Prefetch = n
	}
	if v := get(EnvAMQPAllowUnroutable); v != "" {
		b, err := parseBool(EnvAMQPAllowUnroutable, v)
		errs = append(errs, err)
		cfg.AMQP.AllowUnroutable = b
	}

	if v := get(EnvPubSubProject); v != "" {
		cfg.GoogleCloud.ProjectID = v
		cfg.setSource("GoogleCloud.ProjectID", EnvPubSubProject)
	}
	if v := get(EnvPubSubEmulatorHost); v != "" {
		cfg.GoogleCloud.EmulatorHost = v
		cfg.setSource("GoogleCloud.EmulatorHost", EnvPubSubEmulatorHost)
	}
	if v := get(EnvPubSubCredentialsFile); v != "" {
		cfg.GoogleCloud.CredentialsFile = v
		cfg.setSource("GoogleCloud.CredentialsFile", EnvPubSubCredentialsFile)
	}
	if v := get(EnvPubSubAllowUnreceived); v != "" {
		b, err := parseBool(EnvPubSubAllowUnreceived, v)
		errs = append(errs, err)
		cfg.GoogleCloud.AllowUnreceived = b
	}

	if v := get(EnvSQLURL); v != "" {
		cfg.SQL.URL = v
		cfg.setSource("SQL.URL", EnvSQLURL)
	} else if v := get(EnvDatabaseURL); v != "" && cfg.SQL.URL == "" {
		cfg.SQL.URL = v
		cfg.setSource("SQL.URL", EnvDatabaseURL)
	}
	if v := get(EnvWaitForBroker); v != "" {
		d, err := parseWait(v)
		errs = append(errs, err)
		cfg.WaitForBroker = d
	}

	if v := get(EnvDeclareGroups); v != "" {
		g := splitList(v)
		cfg.AMQP.DeclareGroups = g
		cfg.GoogleCloud.DeclareGroups = g
	}
	if err := errors.Join(errs...); err != nil {
		return cfg, err
	}
	cfg.sealSources(nil)
	return cfg, cfg.Validate()
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

func isKind(k Kind) bool {
	for _, x := range Kinds {
		if x == k {
			return true
		}
	}
	return false
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
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
//	kfake://                                 DEVELOPMENT FAKE: in-process Kafka (kafka.Config.Fake)
//	pstest://[PROJECT]                       DEVELOPMENT FAKE: in-process Pub/Sub (googlecloud.Config.Fake)
//
// The two fakes keep everything in memory and lose it on Close; they are
// for trying millwright and for tests, never for production.
//
// Errors never include the password.
func ParseURL(raw string) (Config, error) {
	var cfg Config
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok || !isScheme(scheme) {
		// Not echoed: without a scheme nothing tells which part is a
		// password (what stands before a later "://" may be one).
		return cfg, errors.New("transport: URL has no scheme (not shown: it may hold a password): want kafka://, amqp://, amqps://, gcppubsub://, postgres:// or mem://")
	}
	switch strings.ToLower(scheme) {
	case "kafka":
		c, err := parseKafkaURL(rest)
		if err != nil {
			return cfg, err
		}
		cfg.Kind, cfg.Kafka = Kafka, c
	case "amqp", "amqps":
		if _, err := url.Parse(raw); err != nil {
			return cfg, errors.New("transport: malformed amqp URL (not shown: it may hold a password): want amqp://user:pass@host:5672/vhost")
		}
		cfg.Kind, cfg.AMQP.URL = AMQP, raw
	case "gcppubsub", "pubsub":
		u, err := url.Parse(raw)
		if err != nil {
			return cfg, fmt.Errorf("transport: malformed gcppubsub URL: want gcppubsub://PROJECT: %v", redact.Error(err))
		}
		if u.Host == "" {
			return cfg, errors.New("transport: gcppubsub URL has no project id: want gcppubsub://PROJECT")
		}
		cfg.Kind = GoogleCloud
		cfg.GoogleCloud.ProjectID = u.Host
		cfg.GoogleCloud.EmulatorHost = u.Query().Get("emulator")
		cfg.GoogleCloud.CredentialsFile = u.Query().Get("credentials_file")
	case "postgres", "postgresql":
		if _, err := url.Parse(raw); err != nil {
			return cfg, errors.New("transport: malformed postgres URL (not shown: it may hold a password): want postgres://user:pass@host:5432/db")
		}
		cfg.Kind, cfg.SQL.URL = SQL, raw
	case "mem", "gochannel":
		if rest != "" && rest != "/" {
			return cfg, fmt.Errorf("transport: %s:// takes no host or path (got %q): write mem:// for the in-process gochannel transport", scheme, quoteShort(rest))
		}
		cfg.Kind = GoChannel
	case FakeKafka:
		if rest != "" && rest != "/" {
			return cfg, fmt.Errorf("transport: kfake:// takes no address (got %q): it starts its own in-process broker; for a real cluster write kafka://host:9092", quoteShort(rest))
		}
		cfg.Kind, cfg.Kafka.Fake = Kafka, true
	case FakePubSub:
		u, err := url.Parse(raw)
		if err != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return cfg, fmt.Errorf("transport: malformed pstest URL: want pstest:// or pstest://PROJECT (the in-process development fake)")
		}
		cfg.Kind, cfg.GoogleCloud.Fake = GoogleCloud, true
		cfg.GoogleCloud.ProjectID = u.Host
	default:
		return cfg, fmt.Errorf("transport: unknown URL scheme %q: want kafka, amqp, amqps, gcppubsub, postgres or mem, or a development fake: kfake, pstest", quoteShort(scheme))
	}
	for _, f := range urlFields[cfg.Kind] {
		cfg.setSource(f, SourceURL)
	}
	cfg.sealSources(nil)
	return cfg, cfg.Validate()
}

// urlFields are the settings a URL of each kind gives (see Setting).
var urlFields = map[Kind][]string{
	Kafka:       {"Kafka.Brokers", "Kafka.SASL", "Kafka.TLS"},
	AMQP:        {"AMQP.URL"},
	GoogleCloud: {"GoogleCloud.ProjectID", "GoogleCloud.EmulatorHost", "GoogleCloud.CredentialsFile"},
	SQL:         {"SQL.URL"},
}

// parseKafkaURL parses [user[:pass]@]h1:p1,h2:p2[/][?sasl=...&tls=...&ca_file=...&partitioner=...].
// net/url cannot: it refuses a comma-separated host list.
func parseKafkaURL(rest string) (c KafkaConfig, err error) {
	rest, query, _ := strings.Cut(rest, "?")
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		userinfo := rest[:at]
		rest = rest[at+1:]
		user, pass, _ := strings.Cut(userinfo, ":")
		if user, err = url.PathUnescape(user); err != nil {
			return c, errors.New("transport: kafka URL has a malformed user name")
		}
		if pass, err = url.PathUnescape(pass); err != nil {
			return c, errors.New("transport: kafka URL has a malformed password (not shown)")
		}
		c.SASL.User, c.SASL.Password = user, pass
		c.SASL.Mechanism = "PLAIN"
	}
	rest = strings.TrimSuffix(rest, "/")
	c.Brokers = splitList(rest)
	if len(c.Brokers) == 0 {
		return c, errors.New("transport: kafka URL has no brokers: want kafka://host1:9092,host2:9092")
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return c, fmt.Errorf("transport: kafka URL has a malformed query: %v", err)
	}
	if m := q.Get("sasl"); m != "" {
		c.SASL.Mechanism = strings.ToUpper(m)
	}
	if p := q.Get("partitioner"); p != "" {
		c.Partitioner = strings.ToLower(p)
	}
	tlsOn, err := parseBool("tls", q.Get("tls"))
	if err != nil {
		return c, fmt.Errorf("transport: kafka URL: %w", err)
	}
	if ca := q.Get("ca_file"); tlsOn || ca != "" {
		t, err := loadTLS(ca, false)
		if err != nil {
			return c, fmt.Errorf("transport: kafka URL ca_file: %w", err)
		}
		c.TLS = t
	}
	return c, nil
}

// quoteShort cuts v for an error message.
func quoteShort(v string) string {
	if len(v) > 64 {
		return v[:64] + "..."
	}
	return v
}
