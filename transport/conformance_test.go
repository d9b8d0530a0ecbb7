package transport_test

import (
	"context"
	stdsql "database/sql"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	_ "github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/embedded"
)

// Environment variables that point the conformance suite at real brokers
// instead of the embedded fakes and local services.
const (
	envTestKafkaBrokers  = "MILLWRIGHT_TEST_KAFKA_BROKERS"
	envTestPubSubHost    = "MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST"
	envTestPubSubProject = "MILLWRIGHT_TEST_PUBSUB_PROJECT"
	envTestAMQPURL       = "MILLWRIGHT_TEST_AMQP_URL"
)

var (
	kafkaOnce sync.Once
	kafkaCfg  transport.Config
	kafkaErr  error

	pubsubOnce sync.Once
	pubsubCfg  transport.Config
	pubsubErr  error
)

// envTestFull runs Watermill's suite with its full message counts; by
// default it runs in its short mode even without -short, which keeps the
// race-enabled CI run within minutes.
const envTestFull = "MILLWRIGHT_TEST_FULL"

func short() bool { return os.Getenv(envTestFull) == "" }

// kafkaConfig reaches MILLWRIGHT_TEST_KAFKA_BROKERS, or an embedded kfake
// cluster shared by the package's tests.
func kafkaConfig(t *testing.T) transport.Config {
	kafkaOnce.Do(func() {
		if b := os.Getenv(envTestKafkaBrokers); b != "" {
			kafkaCfg = transport.Config{Kind: transport.Kafka}
			kafkaCfg.Kafka.Brokers = strings.Split(b, ",")
			return
		}
		var c *embedded.KafkaCluster
		c, kafkaErr = embedded.Kafka()
		if kafkaErr == nil {
			kafkaCfg = c.Config() // lives until the test binary exits
		}
	})
	require.NoError(t, kafkaErr)
	return kafkaCfg
}

// pubsubConfig reaches MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST, or an
// embedded pstest server shared by the package's tests.
func pubsubConfig(t *testing.T) transport.Config {
	pubsubOnce.Do(func() {
		if h := os.Getenv(envTestPubSubHost); h != "" {
			pubsubCfg = transport.Config{Kind: transport.GoogleCloud}
			pubsubCfg.GoogleCloud.EmulatorHost = h
			pubsubCfg.GoogleCloud.MaxExtension = 10 * time.Second
			pubsubCfg.GoogleCloud.ProjectID = "millwright-test"
			if p := os.Getenv(envTestPubSubProject); p != "" {
				pubsubCfg.GoogleCloud.ProjectID = p
			}
			return
		}
		var s *embedded.PubSubServer
		s, pubsubErr = embedded.PubSub()
		if pubsubErr == nil {
			pubsubCfg = s.Config()
		}
	})
	require.NoError(t, pubsubErr)
	return pubsubCfg
}

func amqpConfig() transport.Config {
	c := transport.Config{Kind: transport.AMQP}
	c.AMQP.URL = "amqp://guest:guest@127.0.0.1:5672/"
	if u := os.Getenv(envTestAMQPURL); u != "" {
		c.AMQP.URL = u
	}
	return c
}

// sqlConfig shares one pool on an isolated schema between every
// transport the suite opens, so the suite cannot exhaust the server's
// connections.
func sqlConfig(db *stdsql.DB) transport.Config {
	c := transport.Config{Kind: transport.SQL}
	c.SQL.DB = db
	return c
}

// constructors builds Watermill suite constructors that go through
// transport.Open, never through a broker package.
func constructors(cfgFn func(t *testing.T) transport.Config, defaultGroup string) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		tr, err := transport.Open(context.Background(), cfgFn(t))
		require.NoError(t, err)
		t.Cleanup(func() { _ = tr.Close() })
		sub, err := tr.Subscriber(group)
		require.NoError(t, err)
		return tr.Publisher(), sub
	}
	return func(t *testing.T) (message.Publisher, message.Subscriber) { return withGroup(t, defaultGroup) }, withGroup
}

func TestConformance(t *testing.T) {
	t.Parallel()

	t.Run("gochannel", func(t *testing.T) {
		t.Parallel()
		// One in-process pub/sub must serve both sides, as upstream's test.
		tr, err := transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tr.Close() })
		tests.TestPubSub(t, tests.Features{
			ForceShort:            short(),
			ConsumerGroups:        false,
			ExactlyOnceDelivery:   true,
			GuaranteedOrder:       false,
			Persistent:            false,
			RequireSingleInstance: true,
		}, func(t *testing.T) (message.Publisher, message.Subscriber) {
			tr, err := transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
			require.NoError(t, err)
			sub, err := tr.Subscriber("")
			require.NoError(t, err)
			return tr.Publisher(), sub
		}, nil)
	})

	t.Run("sql", func(t *testing.T) {
		t.Parallel()
		schema := pgtest.New(t)
		pub, group := constructors(func(*testing.T) transport.Config { return sqlConfig(schema.DB) }, "test")
		tests.TestPubSub(t, tests.Features{
			ForceShort:          short(),
			ConsumerGroups:      true,
			ExactlyOnceDelivery: true,
			GuaranteedOrder:     true,
			Persistent:          true,
		}, pub, group)
	})

	t.Run("amqp", func(t *testing.T) {
		t.Parallel()
		pub, group := constructors(func(*testing.T) transport.Config { return amqpConfig() }, "")
		tests.TestPubSub(t, tests.Features{
			ForceShort:          short(),
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false,
			// Prefetch 100 (the default) lets a requeued message fall
			// behind later ones; upstream's ordered runs use prefetch 1.
			GuaranteedOrder:                     false,
			GuaranteedOrderWithSingleSubscriber: false,
			Persistent:                          true,
		}, pub, group)
	})

	t.Run("kafka", func(t *testing.T) {
		t.Parallel()
		pub, group := constructors(kafkaConfig, "test")
		tests.TestPubSub(t, tests.Features{
			ForceShort:          short(),
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false,
			GuaranteedOrder:     false,
			Persistent:          true,
		}, pub, group)
	})

	t.Run("googlecloud", func(t *testing.T) {
		t.Parallel()
		pub, group := constructors(pubsubConfig, "")
		tests.TestPubSub(t, tests.Features{
			ForceShort:          short(),
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false,
			GuaranteedOrder:     false,
			Persistent:          true,
		}, pub, group)
	})
}
