package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

// parseBrokerFlags parses args into a command with the broker flags and
// returns what benchBrokersFromFlags reads from them.
func parseBrokerFlags(t *testing.T, args ...string) (benchBrokers, error) {
	t.Helper()
	cmd := &cobra.Command{Use: "x"}
	addBenchBrokerFlags(cmd)
	require.NoError(t, cmd.ParseFlags(args))
	return benchBrokersFromFlags(cmd)
}

func TestBenchBrokersFromFlags(t *testing.T) {
	// Not parallel: t.Setenv.
	t.Setenv(transport.EnvKafkaBrokers, "")
	t.Setenv(transport.EnvPubSubEmulatorHost, "")
	t.Setenv(transport.EnvAMQPURL, "")

	t.Run("defaults are the fakes", func(t *testing.T) {
		b, err := parseBrokerFlags(t)
		require.NoError(t, err)
		require.Empty(t, b.kafka)
		require.Empty(t, b.emulator)
		require.Equal(t, defaultAMQPURL, b.amqpURL)
		require.Empty(t, b.notice([]transport.Kind{transport.Kafka, transport.GoogleCloud}))
	})

	t.Run("flags name real brokers", func(t *testing.T) {
		b, err := parseBrokerFlags(t, "--kafka-brokers", " h1:9092, h2:9092 ,", "--pubsub-emulator", "127.0.0.1:8085", "--amqp-url", "amqp://u:p@rabbit:5672/")
		require.NoError(t, err)
		require.Equal(t, []string{"h1:9092", "h2:9092"}, b.kafka)
		require.Equal(t, "127.0.0.1:8085", b.emulator)
		require.Equal(t, []string{
			"kafka: real brokers h1:9092,h2:9092 (from --kafka-brokers)",
			"googlecloud: Pub/Sub emulator 127.0.0.1:8085 (from --pubsub-emulator)",
		}, b.notice([]transport.Kind{transport.Kafka, transport.GoogleCloud}))

		k, err := b.open(transport.Kafka)
		require.NoError(t, err)
		require.Equal(t, "kafka h1:9092,h2:9092", k.Label)
		require.Equal(t, []string{"h1:9092", "h2:9092"}, k.Config.Kafka.Brokers)
		ps, err := b.open(transport.GoogleCloud)
		require.NoError(t, err)
		require.Equal(t, "pubsub-emulator 127.0.0.1:8085", ps.Label)
		require.Equal(t, "127.0.0.1:8085", ps.Config.GoogleCloud.EmulatorHost)
		mq, err := b.open(transport.AMQP)
		require.NoError(t, err)
		require.Equal(t, "rabbitmq rabbit:5672", mq.Label, "no credentials in the label")
	})

	t.Run("environment, and an explicit empty flag overrides it", func(t *testing.T) {
		t.Setenv(transport.EnvKafkaBrokers, "envhost:9092")
		t.Setenv(transport.EnvPubSubEmulatorHost, "envhost:8085")
		b, err := parseBrokerFlags(t)
		require.NoError(t, err)
		require.Equal(t, []string{"envhost:9092"}, b.kafka)
		require.Equal(t, "envhost:8085", b.emulator)
		require.Contains(t, b.notice([]transport.Kind{transport.Kafka}), "kafka: real brokers envhost:9092 (from $MILLWRIGHT_KAFKA_BROKERS)")

		b, err = parseBrokerFlags(t, "--kafka-brokers=", "--pubsub-emulator=")
		require.NoError(t, err)
		require.Empty(t, b.kafka)
		require.Empty(t, b.emulator)
	})

	t.Run("malformed addresses", func(t *testing.T) {
		_, err := parseBrokerFlags(t, "--kafka-brokers", "localhost")
		require.ErrorContains(t, err, `--kafka-brokers "localhost"`)
		require.ErrorContains(t, err, "want host:port")
		_, err = parseBrokerFlags(t, "--pubsub-emulator", "http://localhost:8085")
		require.ErrorContains(t, err, "want host:port of a Pub/Sub emulator")
	})
}

func TestBenchBrokerFakes(t *testing.T) {
	t.Parallel()
	var b benchBrokers
	k, err := b.open(transport.Kafka)
	require.NoError(t, err)
	defer k.Close()
	require.Equal(t, "kfake", k.Label)
	require.NotEmpty(t, k.Config.Kafka.Brokers)
	ps, err := b.open(transport.GoogleCloud)
	require.NoError(t, err)
	defer ps.Close()
	require.Equal(t, "pstest", ps.Label)
	gc, err := b.open(transport.GoChannel)
	require.NoError(t, err)
	require.Equal(t, "in-process", gc.Label)
	_, err = b.open(transport.SQL)
	require.Error(t, err)
}

func TestBenchKinds(t *testing.T) {
	t.Parallel()
	kinds, err := benchKinds("saga", []string{"kafka", " GoChannel", "kafka"}, transport.GoChannel, transport.Kafka)
	require.NoError(t, err)
	require.Equal(t, []transport.Kind{transport.Kafka, transport.GoChannel}, kinds)

	_, err = benchKinds("saga", []string{"amqp"}, transport.GoChannel, transport.Kafka, transport.GoogleCloud)
	require.EqualError(t, err, "bench saga: --kinds amqp: this benchmark does not run on amqp: want one of gochannel, kafka, googlecloud")
	_, err = benchKinds("outbox", []string{"kafak"}, transport.GoChannel, transport.Kafka)
	require.EqualError(t, err, `bench outbox: --kinds: invalid transport "kafak": want one of gochannel, kafka`)
	_, err = benchKinds("outbox", []string{""}, transport.GoChannel)
	require.ErrorContains(t, err, "--kinds is empty")
}

// The bench commands refuse bad --kinds and broker flags before they touch
// a database or a broker.
func TestBenchCommandsRefuseBadFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cmd  func() *cobra.Command
		args []string
		want string
	}{
		{benchSagaCmd, []string{"--kinds", "gochannel,nsq"}, `bench saga: --kinds: invalid transport "nsq": want one of gochannel, kafka, googlecloud, amqp, sql`},
		{benchSagaCmd, []string{"--kafka-brokers", "nohost"}, `--kafka-brokers "nohost"`},
		{benchOutboxCmd, []string{"--kinds", "nsq"}, `bench outbox: --kinds: invalid transport "nsq": want one of gochannel, kafka, googlecloud, amqp, sql, nats`},
		{benchOutboxCmd, []string{"--pubsub-emulator", "nohost"}, `--pubsub-emulator "nohost"`},
	} {
		_, _, err := runCLI(t, tc.cmd(), nil, "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=1", tc.args...)
		require.ErrorContains(t, err, tc.want, tc.args)
	}
}

// --cpuprofile writes a CPU profile of a bench run, also of one that fails
// (main stops the profile when PersistentPostRunE is skipped).
func TestBenchCPUProfile(t *testing.T) { // not parallel: the global rootCmd
	path := filepath.Join(t.TempDir(), "cpu.pprof")
	_, _, err := runCLI(t, rootCmd, nil, "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=1",
		"saga", "--kinds", "nsq", "--cpuprofile", path)
	require.ErrorContains(t, err, `invalid transport "nsq"`)
	require.NoError(t, stopCPUProfile())
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(b), 2)
	require.Equal(t, []byte{0x1f, 0x8b}, b[:2], "not a gzip-compressed pprof profile")
	require.NoError(t, rootCmd.PersistentFlags().Set("cpuprofile", ""))
}
