package kafka_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

// The key-parallel consumer's settings load from the environment and
// refuse values that cannot work, naming the variable.
func TestKeyParallelismSettings(t *testing.T) { // not parallel: Setenv
	t.Setenv(transport.EnvTransport, "kafka")
	t.Setenv(transport.EnvKafkaBrokers, "127.0.0.1:9092")
	t.Setenv(transport.EnvKafkaKeyParallelism, "8")
	t.Setenv(transport.EnvKafkaKeyMaxInFlight, "64")
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, 8, cfg.Kafka.KeyParallelism)
	require.Equal(t, 64, cfg.Kafka.KeyMaxInFlight)
	require.NoError(t, cfg.Kafka.Validate())

	t.Setenv(transport.EnvKafkaKeyParallelism, "many")
	_, err = transport.FromEnv()
	require.ErrorContains(t, err, "MILLWRIGHT_KAFKA_KEY_PARALLELISM=\"many\"")

	cfg.Kafka.KeyMaxInFlight = 4
	require.ErrorContains(t, cfg.Kafka.Validate(), "KeyMaxInFlight 4")
	cfg.Kafka.KeyParallelism, cfg.Kafka.KeyMaxInFlight = -1, 0
	require.ErrorContains(t, cfg.Kafka.Validate(), "KeyParallelism -1 is negative")
}
