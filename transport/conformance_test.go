package transport_test

import (
	"context"
	stdsql "database/sql"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	_ "github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// envTestShort runs Watermill's suite in its short mode (fewer messages),
// for a quick local run; CI runs the full mode.
const envTestShort = "MILLWRIGHT_TEST_SHORT"

func short() bool { return os.Getenv(envTestShort) != "" }

// envTestPubSubFull runs the Pub/Sub kind in full mode too. Off in the
// main run, where the emulator is slowest; .ci/run runs the full mode for
// Pub/Sub in a stage of its own, without upstream's
// TestContinueAfterSubscribeClose, which stops looking before the leases
// of its closed subscribers have ended (see
// TestPubSubSubscriberClosedMidReadLosesNothing).
const envTestPubSubFull = "MILLWRIGHT_TEST_PUBSUB_FULL"

// envTestReconnect enables Watermill's TestReconnect, which cuts or
// restarts the broker under the suite (see reconnectCommand). It is off by
// default because the cut reaches every client of the broker: .ci/run
// runs the reconnect tests alone, after the rest of the suite.
const envTestReconnect = "MILLWRIGHT_TEST_RECONNECT"

// reconnectCommand returns the command Watermill's TestReconnect runs to
// cut the broker of the given kind (nil, so the test skips, unless
// MILLWRIGHT_TEST_RECONNECT=1). Each command fails when its cut found
// nothing to cut.
//
//   - amqp: rabbitmqctl close_all_connections (the server closes every
//     client connection; the publisher and subscribers reconnect).
//   - sql: pg_terminate_backend of the suite's own connections, found by
//     their application_name (the other tests' sessions live on).
//   - kafka: scripts/services.sh restart kafka stops the broker process and
//     starts it again on the same log directory.
//   - nats: scripts/services.sh restart nats stops nats-server and starts
//     it again on the same JetStream store.
//   - googlecloud: the emulator keeps its state in memory, so a restart
//     would lose the topics and messages the test checks; instead the
//     suite reaches it through a TCP proxy (internal/testing/faultproxy) and the
//     command signals this process (SIGUSR1), which cuts every connection
//     the proxy carries: the client sees the server go away mid-stream.
//
// With MILLWRIGHT_TEST_RECONNECT=1, a kind that cannot be cut fails the
// test instead of letting TestReconnect skip silently.
func reconnectCommand(t *testing.T, kind transport.Kind, appName string) []string {
	if os.Getenv(envTestReconnect) != "1" {
		return nil
	}
	cmd, why := reconnectCommandFor(t, kind, appName)
	if cmd == nil {
		t.Fatalf("%s=1 but %s cannot be cut: %s", envTestReconnect, kind, why)
	}
	return cmd
}

func reconnectCommandFor(t *testing.T, kind transport.Kind, appName string) ([]string, string) {
	script, err := filepath.Abs(filepath.Join("..", "scripts", "services.sh"))
	require.NoError(t, err)
	switch kind {
	case transport.AMQP:
		// Fails when there was no connection to close: the cut must
		// really happen.
		return []string{"sh", "-c", `test "$(rabbitmqctl -q list_connections | wc -l)" -gt 0 && rabbitmqctl -q close_all_connections "millwright reconnect test"`}, ""
	case transport.SQL:
		// Fails (division by zero) when no session was terminated: the
		// cut must really happen.
		return []string{"psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", pgtest.ToolURL(), "-c",
			"SELECT 1 / count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '" + appName + "') cut"}, ""
	case transport.Kafka:
		cfg := transporttest.Config(t, kind)
		if !transporttest.Real(kind) || strings.Join(cfg.Kafka.Brokers, ",") != transporttest.DefaultKafkaBroker {
			return nil, "the Kafka broker is not the one scripts/services.sh runs, which is the only one this test may restart"
		}
		return []string{"bash", script, "restart", "kafka"}, ""
	case transport.GoogleCloud:
		return []string{"kill", "-USR1", strconv.Itoa(os.Getpid())}, ""
	case transport.NATS:
		if transporttest.NATSURL() != transporttest.DefaultNATSURL {
			return nil, "the nats-server is not the one scripts/services.sh runs, which is the only one this test may restart"
		}
		return []string{"bash", script, "restart", "nats"}, ""
	}
	return nil, "no broker to cut"
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
		// A pool per transport, as watermill-sql's own run of the suite
		// has: each in-flight message holds a connection in a
		// transaction until it is acked, so one shared, bounded pool
		// starves the suite's parallel tests. Named, so that the
		// reconnect test can terminate exactly these sessions.
		appName := "millwright_conformance_" + schema.Name
		suiteURL := withParam(schema.URL, "application_name", appName)
		restart := reconnectCommand(t, transport.SQL, appName)
		pub, group := constructors(func(*testing.T) transport.Config {
			c := transport.Config{Kind: transport.SQL}
			c.SQL.URL = suiteURL
			c.SQL.MaxOpenConns = 100
			c.SQL.PollInterval = time.Millisecond
			c.SQL.ResendInterval = 5 * time.Millisecond
			return c
		}, "test")
		tests.TestPubSub(t, tests.Features{
			ForceShort:            short(),
			ConsumerGroups:        true,
			ExactlyOnceDelivery:   true,
			GuaranteedOrder:       true,
			Persistent:            true,
			RestartServiceCommand: restart,
		}, pub, group)
	})

	t.Run("amqp", func(t *testing.T) {
		t.Parallel()
		restart := reconnectCommand(t, transport.AMQP, "")
		pub, group := constructors(func(t *testing.T) transport.Config { return transporttest.Config(t, transport.AMQP) }, "")
		tests.TestPubSub(t, tests.Features{
			RestartServiceCommand: restart,
			ForceShort:            short(),
			ConsumerGroups:        true,
			ExactlyOnceDelivery:   false,
			// Prefetch 100 (the default) lets a requeued message fall
			// behind later ones; upstream's ordered runs use prefetch 1.
			GuaranteedOrder:                     false,
			GuaranteedOrderWithSingleSubscriber: false,
			Persistent:                          true,
		}, pub, group)
	})

	t.Run("kafka", func(t *testing.T) {
		t.Parallel()
		restart := reconnectCommand(t, transport.Kafka, "")
		pub, group := constructors(func(t *testing.T) transport.Config { return transporttest.Config(t, transport.Kafka) }, "test")
		tests.TestPubSub(t, tests.Features{
			RestartServiceCommand: restart,
			ForceShort:            short(),
			ConsumerGroups:        true,
			ExactlyOnceDelivery:   false,
			GuaranteedOrder:       false,
			Persistent:            true,
		}, pub, group)
	})

	t.Run("nats", func(t *testing.T) {
		t.Parallel()
		restart := reconnectCommand(t, transport.NATS, "")
		pub, group := constructors(func(t *testing.T) transport.Config {
			c := transporttest.Config(t, transport.NATS)
			// TestMessageCtx wants a message's context cancelled within
			// 30s of Close while it is still unacked: the drain bound.
			c.NATS.KeyDrainTimeout = 5 * time.Second
			return c
		}, "test")
		tests.TestPubSub(t, tests.Features{
			RestartServiceCommand: restart,
			ForceShort:            short(),
			ConsumerGroups:        true,
			ExactlyOnceDelivery:   false,
			// One message at a time, in stream order, a nacked one run
			// again in its place (KeyParallelism 0), by one member of the
			// group at a time (the pinned one): the suite's ten
			// subscribers of one group keep the order too.
			GuaranteedOrder: true,
			Persistent:      true,
		}, pub, group)
	})

	// Not parallel with the other kinds: it runs first, alone in this
	// package, and in short mode unless MILLWRIGHT_TEST_PUBSUB_FULL=1 (see
	// envTestPubSubFull).
	t.Run("googlecloud", func(t *testing.T) {
		cfg := transporttest.Config(t, transport.GoogleCloud)
		restart := reconnectCommand(t, transport.GoogleCloud, "")
		if restart != nil {
			proxy, err := faultproxy.New(cfg.GoogleCloud.EmulatorHost)
			require.NoError(t, err)
			t.Cleanup(func() { _ = proxy.Close() })
			cfg.GoogleCloud.EmulatorHost = proxy.Addr()
			cut := make(chan os.Signal, 1)
			signal.Notify(cut, syscall.SIGUSR1)
			t.Cleanup(func() { signal.Stop(cut) })
			go func() {
				for range cut {
					proxy.Cut()
				}
			}()
			t.Cleanup(func() {
				if !t.Skipped() {
					require.Positive(t, proxy.CutConns(), "the reconnect test never cut a connection to the emulator")
				}
			})
		}
		pub, group := constructors(func(*testing.T) transport.Config { return cfg }, "")
		tests.TestPubSub(t, tests.Features{
			RestartServiceCommand: restart,
			ForceShort:            short() || os.Getenv(envTestPubSubFull) != "1",
			ConsumerGroups:        true,
			ExactlyOnceDelivery:   false,
			GuaranteedOrder:       false,
			Persistent:            true,
		}, pub, group)
	})
}

// withParam sets one query parameter of a postgres:// URL.
func withParam(rawURL, key, value string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL + " " + key + "=" + value
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// sqlConfig shares one pool on an isolated schema between every
// transport a test opens, so the suite cannot exhaust the server's
// connections.
func sqlConfig(db *stdsql.DB) transport.Config {
	c := transport.Config{Kind: transport.SQL}
	c.SQL.DB = db
	return c
}
