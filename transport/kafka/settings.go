package kafka

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/millwright/millwright/internal/envparse"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL and transport.FromEnv read the
// kafka kind: kafka:// and kfake:// URLs and the MILLWRIGHT_KAFKA_*
// variables.
var kindSettings = transport.Settings{
	Schemes:  []string{"kafka"},
	Fakes:    []transport.Fake{{Name: transport.FakeKafka, Select: func(c *transport.Config) { c.Kafka.Fake = true }}},
	ParseURL: parseURL,
	FromEnv:  fromEnv,
	Fields: map[string]func(transport.Config) string{
		"Kafka.Brokers": func(c transport.Config) string { return strings.Join(c.Kafka.Brokers, ",") },
		"Kafka.SASL": func(c transport.Config) string {
			return c.Kafka.SASL.Mechanism + "\x00" + c.Kafka.SASL.User + "\x00" + c.Kafka.SASL.Password
		},
		"Kafka.TLS": func(c transport.Config) string { return fmt.Sprintf("%p", c.Kafka.TLS) },
	},
	Describe: describe,
}

func describe(c transport.Config) string {
	if c.Kafka.Fake {
		return "kfake:// (in-process development fake)"
	}
	s := "kafka://" + strings.Join(c.Kafka.Brokers, ",")
	if c.Kafka.SASL.Mechanism != "" {
		s += " sasl=" + c.Kafka.SASL.Mechanism + " user=" + c.Kafka.SASL.User
	}
	if c.Kafka.TLS != nil {
		s += " tls"
	}
	return s
}

func parseURL(c *transport.Config, u transport.URL) error {
	if u.Scheme == transport.FakeKafka {
		if u.Rest != "" && u.Rest != "/" {
			return fmt.Errorf("transport: kfake:// takes no address (got %q): it starts its own in-process broker; for a real cluster write kafka://host:9092", envparse.Short(u.Rest))
		}
		c.Kafka.Fake = true
		return nil
	}
	kc, err := parseKafkaURL(u.Rest)
	if err != nil {
		return err
	}
	c.Kafka = kc
	return nil
}

// parseKafkaURL parses [user[:pass]@]h1:p1,h2:p2[/][?sasl=...&tls=...&ca_file=...&partitioner=...].
// net/url cannot: it refuses a comma-separated host list.
func parseKafkaURL(rest string) (c Config, err error) {
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
	c.Brokers = envparse.List(rest)
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
	tlsOn, err := envparse.Bool("tls", q.Get("tls"))
	if err != nil {
		return c, fmt.Errorf("transport: kafka URL: %w", err)
	}
	if ca := q.Get("ca_file"); tlsOn || ca != "" {
		t, err := envparse.TLS(ca)
		if err != nil {
			return c, fmt.Errorf("transport: kafka URL ca_file: %w", err)
		}
		c.TLS = t
	}
	return c, nil
}

// fromEnv reads the MILLWRIGHT_KAFKA_* variables.
func fromEnv(cfg *transport.Config, env transport.Env) error {
	c := &cfg.Kafka
	var errs []error
	if v := env.Get(transport.EnvKafkaBrokers); v != "" {
		c.Brokers = envparse.List(v)
		env.From("Kafka.Brokers", transport.EnvKafkaBrokers)
	}
	tlsOn, err := envparse.Bool(transport.EnvKafkaTLS, env.Get(transport.EnvKafkaTLS))
	errs = append(errs, err)
	if ca := env.Get(transport.EnvKafkaTLSCAFile); tlsOn || ca != "" {
		t, err := envparse.TLS(ca)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", transport.EnvKafkaTLSCAFile, err))
		}
		c.TLS = t
		if ca != "" {
			env.From("Kafka.TLS", transport.EnvKafkaTLSCAFile)
		} else {
			env.From("Kafka.TLS", transport.EnvKafkaTLS)
		}
	}
	if v := env.Get(transport.EnvKafkaSASLMechanism); v != "" {
		c.SASL.Mechanism = strings.ToUpper(v)
		env.From("Kafka.SASL", transport.EnvKafkaSASLMechanism)
	}
	if v := env.Get(transport.EnvKafkaSASLUser); v != "" {
		c.SASL.User = v
	}
	if v, ok := env.Lookup(transport.EnvKafkaSASLPassword); ok {
		c.SASL.Password = v
	}
	if v := env.Get(transport.EnvKafkaPartitions); v != "" {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("%s=%q: want a positive integer", transport.EnvKafkaPartitions, v))
		}
		c.Partitions = int32(n)
	}
	if v := env.Get(transport.EnvKafkaPartitioner); v != "" {
		c.Partitioner = strings.ToLower(v)
	}
	errs = append(errs, envInt(env, transport.EnvKafkaKeyParallelism, &c.KeyParallelism))
	errs = append(errs, envInt(env, transport.EnvKafkaKeyMaxInFlight, &c.KeyMaxInFlight))
	return errors.Join(errs...)
}

// envInt reads a non-negative integer variable into *dst (the
// key-parallel consumer's settings; 0 keeps the default).
func envInt(env transport.Env, name string, dst *int) error {
	v := env.Get(name)
	if v == "" {
		return nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return fmt.Errorf("%s=%q: want a non-negative integer (0: the default)", name, v)
	}
	*dst = n
	return nil
}
