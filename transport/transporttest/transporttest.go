package transporttest

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // tests use every kind
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
	tnats "github.com/millwright/millwright/transport/nats"
)

// Environment variables naming real brokers for tests.
const (
	EnvKafkaBrokers  = "MILLWRIGHT_TEST_KAFKA_BROKERS"
	EnvPubSubHost    = "MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST"
	EnvPubSubProject = "MILLWRIGHT_TEST_PUBSUB_PROJECT"
	EnvAMQPURL       = "MILLWRIGHT_TEST_AMQP_URL"
	// EnvNATSURL is the nats-server (with JetStream) the nats kind's
	// tests use; default DefaultNATSURL. There is no in-process fallback:
	// a test of the nats kind fails when no server answers.
	EnvNATSURL = "MILLWRIGHT_TEST_NATS_URL"
	// EnvRequireReal fails a test that would fall back to an in-process
	// fake because no real broker answers: "1" or "all" for every kind, or
	// a comma-separated list of kinds ("kafka,googlecloud").
	EnvRequireReal = "MILLWRIGHT_TEST_REAL_BROKERS"
)

// Fake, as the value of EnvKafkaBrokers or EnvPubSubHost, chooses the
// in-process fake even when a real broker is up.
const Fake = "fake"

// The addresses scripts/services.sh starts its brokers on.
const (
	DefaultAMQPURL      = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultKafkaBroker  = "127.0.0.1:9092"
	DefaultPubSubHost   = "127.0.0.1:8085"
	DefaultNATSURL      = "nats://127.0.0.1:4222"
	defaultPubSubProjID = "millwright-test"
)

var (
	kafkaOnce    sync.Once
	kafkaCluster *embedded.KafkaCluster
	kafkaErr     error

	pubsubOnce   sync.Once
	pubsubServer *embedded.PubSubServer
	pubsubErr    error

	choiceOnce sync.Once
	choice     brokers
)

// brokers is what this process's tests run against, decided once.
type brokers struct {
	kafka, pubsub       []string // real addresses; nil = fake
	kafkaWhy, pubsubWhy string   // why the fake, when it is
}

// answers reports whether something accepts TCP connections at addr.
func answers(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}

func choose() brokers {
	choiceOnce.Do(func() {
		switch v := os.Getenv(EnvKafkaBrokers); {
		case v == Fake:
			choice.kafkaWhy = EnvKafkaBrokers + "=fake"
		case v != "":
			choice.kafka = strings.Split(v, ",")
		case answers(DefaultKafkaBroker):
			choice.kafka = []string{DefaultKafkaBroker}
		default:
			choice.kafkaWhy = "no broker answers at " + DefaultKafkaBroker + " and " + EnvKafkaBrokers + " is unset (start one: scripts/services.sh up)"
		}
		switch v := os.Getenv(EnvPubSubHost); {
		case v == Fake:
			choice.pubsubWhy = EnvPubSubHost + "=fake"
		case v != "":
			choice.pubsub = []string{v}
		case answers(DefaultPubSubHost):
			choice.pubsub = []string{DefaultPubSubHost}
		default:
			choice.pubsubWhy = "no emulator answers at " + DefaultPubSubHost + " and " + EnvPubSubHost + " is unset (start one: scripts/services.sh up)"
		}
		fmt.Fprintf(os.Stderr, "transporttest: %s\n", choice.describe())
	})
	return choice
}

func (b brokers) describe() string {
	k := "kafka=real " + strings.Join(b.kafka, ",")
	if b.kafka == nil {
		k = "kafka=FAKE (kfake: " + b.kafkaWhy + ")"
	}
	p := "googlecloud=real emulator " + strings.Join(b.pubsub, ",")
	if b.pubsub == nil {
		p = "googlecloud=FAKE (pstest: " + b.pubsubWhy + ")"
	}
	return fmt.Sprintf("brokers: %s; %s; amqp=real %s; sql=real %s; nats=real %s; gochannel=in-process",
		k, p, redact.URL(AMQPURL()), redact.URL(pgtest.BaseURL()), redact.URL(NATSURL()))
}

// Brokers describes, in one line, which brokers this process's tests use
// and, for a fake, why.
func Brokers() string { return choose().describe() }

// Real reports whether tests of the kind reach a real broker (always true
// for amqp and sql, never for gochannel).
func Real(kind transport.Kind) bool {
	switch kind {
	case transport.Kafka:
		return choose().kafka != nil
	case transport.GoogleCloud:
		return choose().pubsub != nil
	case transport.AMQP, transport.SQL, transport.NATS:
		return true
	}
	return false
}

// fallback is called when a test is about to use a fake because no real
// broker is there: loud in the test's log, fatal under EnvRequireReal.
func fallback(t testing.TB, kind transport.Kind, why string) {
	t.Helper()
	if requireReal(kind) {
		t.Fatalf("transporttest: %s: no real broker and %s=1: %s", kind, EnvRequireReal, why)
	}
	t.Logf("transporttest: WARNING: %s runs on an in-process FAKE: %s", kind, why)
}

// requireReal reports whether EnvRequireReal forbids a fake for the kind.
func requireReal(kind transport.Kind) bool {
	v := os.Getenv(EnvRequireReal)
	if v == "1" || v == "all" {
		return true
	}
	for _, k := range strings.Split(v, ",") {
		if strings.TrimSpace(k) == string(kind) {
			return true
		}
	}
	return false
}

// FakeKafka returns the process-wide kfake cluster, for tests that inject
// faults with its ControlKey, whatever real broker is configured.
func FakeKafka(t testing.TB) *embedded.KafkaCluster {
	t.Helper()
	kafkaOnce.Do(func() { kafkaCluster, kafkaErr = embedded.Kafka() })
	if kafkaErr != nil {
		t.Fatalf("transporttest: starting kfake: %v", kafkaErr)
	}
	return kafkaCluster
}

// FakePubSub returns the process-wide pstest server, for tests that read
// pstest's own view of what was published, whatever emulator is configured.
func FakePubSub(t testing.TB) *embedded.PubSubServer {
	t.Helper()
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
		b := choose()
		if b.kafka == nil {
			fallback(t, kind, b.kafkaWhy)
			return FakeKafka(t).Config()
		}
		c := transport.Config{Kind: kind}
		c.Kafka.Brokers = b.kafka
		return c
	case transport.GoogleCloud:
		b := choose()
		if b.pubsub == nil {
			fallback(t, kind, b.pubsubWhy)
			return FakePubSub(t).Config()
		}
		c := transport.Config{Kind: kind}
		c.GoogleCloud.EmulatorHost = b.pubsub[0]
		c.GoogleCloud.ProjectID = defaultPubSubProjID
		if p := os.Getenv(EnvPubSubProject); p != "" {
			c.GoogleCloud.ProjectID = p
		}
		// A subscriber closed mid-read leaves its messages leased until
		// the extension ends; keep that short so they come back quickly.
		c.GoogleCloud.MaxExtension = 10 * time.Second
		return c
	case transport.AMQP:
		c := transport.Config{Kind: kind}
		c.AMQP.URL = AMQPURL()
		return c
	case transport.SQL:
		c := transport.Config{Kind: kind}
		c.SQL.URL = pgtest.New(t).URL
		c.SQL.MaxOpenConns = 5
		return c
	case transport.NATS:
		c := transport.Config{Kind: kind}
		c.NATS.URL = NATSURL()
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

// NATSURL returns the nats-server URL tests use.
func NATSURL() string {
	if u := os.Getenv(EnvNATSURL); u != "" {
		return u
	}
	return DefaultNATSURL
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

// DeleteNATSStreams deletes the streams of the given topics now (call
// it from t.Cleanup), so tests leave a shared nats-server's store as they
// found it.
func DeleteNATSStreams(t testing.TB, topics []string) {
	t.Helper()
	nc, err := natsgo.Connect(NATSURL())
	if err != nil {
		t.Logf("transporttest: deleting NATS streams: %v", err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return
	}
	for _, topic := range topics {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = js.DeleteStream(ctx, tnats.StreamName(topic))
		cancel()
	}
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
