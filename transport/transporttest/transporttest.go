// Package transporttest gives tests a transport.Config for each kind: the
// real broker named by an environment variable when one is set, otherwise
// the local service (RabbitMQ, Postgres) or an in-process fake (kfake for
// Kafka, pstest for Pub/Sub) shared by every test of the process.
//
//	for _, kind := range transport.Kinds {
//		t.Run(string(kind), func(t *testing.T) {
//			tr := transporttest.Open(t, kind) // closed at cleanup
//			...
//		})
//	}
//
// Environment variables: MILLWRIGHT_TEST_KAFKA_BROKERS (comma-separated),
// MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST (+ MILLWRIGHT_TEST_PUBSUB_PROJECT),
// MILLWRIGHT_TEST_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/),
// MILLWRIGHT_TEST_DATABASE_URL (default the local test database; the sql
// kind gets a fresh schema per call).
package transporttest

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
)

// Environment variables naming real brokers for tests.
const (
	EnvKafkaBrokers  = "MILLWRIGHT_TEST_KAFKA_BROKERS"
	EnvPubSubHost    = "MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST"
	EnvPubSubProject = "MILLWRIGHT_TEST_PUBSUB_PROJECT"
	EnvAMQPURL       = "MILLWRIGHT_TEST_AMQP_URL"
)

// DefaultAMQPURL is the local RabbitMQ every development and CI machine has.
const DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

var (
	kafkaOnce    sync.Once
	kafkaCluster *embedded.KafkaCluster
	kafkaErr     error

	pubsubOnce   sync.Once
	pubsubServer *embedded.PubSubServer
	pubsubErr    error
)

// KafkaCluster returns the process-wide kfake cluster, for fault injection
// with its ControlKey; nil when MILLWRIGHT_TEST_KAFKA_BROKERS names a real
// cluster.
func KafkaCluster(t testing.TB) *embedded.KafkaCluster {
	t.Helper()
	if os.Getenv(EnvKafkaBrokers) != "" {
		return nil
	}
	kafkaOnce.Do(func() { kafkaCluster, kafkaErr = embedded.Kafka() })
	if kafkaErr != nil {
		t.Fatalf("transporttest: starting kfake: %v", kafkaErr)
	}
	return kafkaCluster
}

// PubSubServer returns the process-wide pstest server; nil when
// MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST names an emulator.
func PubSubServer(t testing.TB) *embedded.PubSubServer {
	t.Helper()
	if os.Getenv(EnvPubSubHost) != "" {
		return nil
	}
	pubsubOnce.Do(func() { pubsubServer, pubsubErr = embedded.PubSub() })
	if pubsubErr != nil {
		t.Fatalf("transporttest: starting pstest: %v", pubsubErr)
	}
	return pubsubServer
}

// Config returns a configuration reaching a broker of the given kind.
func Config(t testing.TB, kind transport.Kind) transport.Config {
	t.Helper()
	switch kind {
	case transport.Kafka:
		if b := os.Getenv(EnvKafkaBrokers); b != "" {
			c := transport.Config{Kind: kind}
			c.Kafka.Brokers = strings.Split(b, ",")
			return c
		}
		return KafkaCluster(t).Config()
	case transport.GoogleCloud:
		if h := os.Getenv(EnvPubSubHost); h != "" {
			c := transport.Config{Kind: kind}
			c.GoogleCloud.EmulatorHost = h
			c.GoogleCloud.ProjectID = "millwright-test"
			if p := os.Getenv(EnvPubSubProject); p != "" {
				c.GoogleCloud.ProjectID = p
			}
			c.GoogleCloud.MaxExtension = 10 * time.Second
			return c
		}
		return PubSubServer(t).Config()
	case transport.AMQP:
		c := transport.Config{Kind: kind}
		c.AMQP.URL = AMQPURL()
		return c
	case transport.SQL:
		c := transport.Config{Kind: kind}
		c.SQL.URL = pgtest.New(t).URL
		c.SQL.MaxOpenConns = 5
		return c
	case transport.GoChannel:
		return transport.Config{Kind: kind}
	}
	t.Fatalf("transporttest: unknown kind %q", kind)
	return transport.Config{}
}

// AMQPURL returns the RabbitMQ URL tests use.
func AMQPURL() string {
	if u := os.Getenv(EnvAMQPURL); u != "" {
		return u
	}
	return DefaultAMQPURL
}

// Open opens a transport of the given kind and closes it at cleanup.
func Open(t testing.TB, kind transport.Kind) *transport.Transport {
	t.Helper()
	tr, err := transport.Open(context.Background(), Config(t, kind))
	if err != nil {
		t.Fatalf("transporttest: opening %s: %v", kind, err)
	}
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

// DeleteAMQPTopology deletes, at test cleanup, the exchanges of the given
// topics and the queues of the given groups on them, so tests leave a
// shared RabbitMQ as they found it.
func DeleteAMQPTopology(t testing.TB, topics []string, groups ...string) {
	t.Helper()
	t.Cleanup(func() {
		_ = amqp.DeleteTopology(AMQPURL(), topics, append([]string{""}, groups...)...)
	})
}
