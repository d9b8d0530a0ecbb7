package amqp_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

// The key-parallel consumer's settings load from the environment and
// refuse values that cannot work, naming the variable and the fix.
func TestKeyParallelismSettings(t *testing.T) { // not parallel: Setenv
	t.Setenv(transport.EnvTransport, "amqp")
	t.Setenv(transport.EnvAMQPURL, "amqp://guest:guest@127.0.0.1:5672/")
	t.Setenv(transport.EnvAMQPKeyParallelism, "8")
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, 8, cfg.AMQP.KeyParallelism)
	require.NoError(t, cfg.AMQP.Validate(), "Prefetch unset: it defaults to 16 x KeyParallelism")

	t.Setenv(transport.EnvAMQPKeyParallelism, "many")
	_, err = transport.FromEnv()
	require.ErrorContains(t, err, "MILLWRIGHT_AMQP_KEY_PARALLELISM=\"many\"")

	cfg.AMQP.Prefetch = 4
	require.ErrorContains(t, cfg.AMQP.Validate(), "Prefetch 4 is below KeyParallelism 8")
	cfg.AMQP.Prefetch = 70000
	require.ErrorContains(t, cfg.AMQP.Validate(), "Prefetch 70000 is above 65535")
	cfg.AMQP.KeyParallelism, cfg.AMQP.Prefetch = -1, 0
	require.ErrorContains(t, cfg.AMQP.Validate(), "KeyParallelism -1 is negative")
}
