package transport_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

// Setting names the variable or URL each connection setting came from,
// and Config.X once code has changed the value.
func TestSettingNamesWhereEachValueCameFrom(t *testing.T) {
	t.Setenv(transport.EnvTransport, "amqp://guest:pw@h:5672/")
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, transport.EnvTransport, cfg.Setting("AMQP.URL"))
	cfg.AMQP.URL = "amqp://other:5672/"
	require.Equal(t, "Config.AMQP.URL", cfg.Setting("AMQP.URL"), "a value changed in code is not the environment's")

	t.Setenv(transport.EnvAMQPURL, "amqp://guest:pw@h2:5672/")
	cfg, err = transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, transport.EnvAMQPURL, cfg.Setting("AMQP.URL"), "the per-kind variable overrides the URL")

	t.Setenv(transport.EnvTransport, "sql")
	t.Setenv(transport.EnvDatabaseURL, "postgres://u@h/db")
	cfg, err = transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, transport.EnvDatabaseURL, cfg.Setting("SQL.URL"))

	t.Setenv(transport.EnvTransport, "kafka://u:pw@h:9092?tls=true")
	t.Setenv(transport.EnvKafkaSASLMechanism, "SCRAM-SHA-512")
	t.Setenv(transport.EnvWaitForBroker, "90s")
	cfg, err = transport.FromEnv()
	require.NoError(t, err)
	require.Equal(t, transport.EnvTransport, cfg.Setting("Kafka.Brokers"))
	require.Equal(t, transport.EnvTransport, cfg.Setting("Kafka.TLS"))
	require.Equal(t, transport.EnvKafkaSASLMechanism, cfg.Setting("Kafka.SASL"))
	require.Equal(t, 90*time.Second, cfg.WaitForBroker)

	cfg, err = transport.ParseURL("kafka://h:9092")
	require.NoError(t, err)
	require.Equal(t, transport.SourceURL, cfg.Setting("Kafka.Brokers"))
	require.Equal(t, "Config.Kafka.SASL", transport.Config{}.Setting("Kafka.SASL"))

	t.Setenv(transport.EnvWaitForBroker, "soon")
	_, err = transport.FromEnv()
	require.ErrorContains(t, err, transport.EnvWaitForBroker+`="soon"`)
}

func TestWaitForBrokerValidates(t *testing.T) {
	t.Parallel()
	cfg := transport.Config{Kind: transport.GoChannel, WaitForBroker: -2}
	require.ErrorContains(t, cfg.Validate(), "WaitForBroker -2ns")
	cfg.WaitForBroker = transport.NoWait
	require.NoError(t, cfg.Validate())
}
