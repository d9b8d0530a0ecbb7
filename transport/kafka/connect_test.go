package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// plaintextBroker is the real broker's PLAINTEXT listener, or the test
// is skipped.
func plaintextBroker(t *testing.T) string {
	t.Helper()
	if !transporttest.Real(transport.Kafka) {
		t.Skip("needs the real Kafka broker (" + transporttest.Brokers() + ")")
	}
	return transporttest.Config(t, transport.Kafka).Kafka.Brokers[0]
}

// openFromEnv opens the transport MILLWRIGHT_ variables describe and
// returns its error, requiring that Open gave up at once: a listener
// mismatch is not waited for.
func openFromEnv(t *testing.T) error {
	t.Helper()
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	cfg.Kafka.ConnectTimeout = 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr, err := transport.Open(ctx, cfg)
	if err == nil {
		_ = tr.Close()
	}
	require.Error(t, err)
	require.NotErrorIs(t, err, transport.ErrGaveUpWaiting, "a listener mismatch must fail at once, not be waited for")
	require.True(t, failure.IsPermanent(err), "a listener mismatch is permanent: %v", err)
	require.NotContains(t, err.Error(), "hunter2")
	t.Log(err)
	return err
}

// SASL credentials against the broker's PLAINTEXT listener: the error
// says the broker refused the SASL handshake, that it is a listener
// mismatch, and names the variables the brokers and the mechanism came
// from, instead of Sarama's "client has run out of available brokers".
func TestSASLAgainstAPlaintextListenerSaysListenerMismatch(t *testing.T) {
	addr := plaintextBroker(t)
	t.Setenv(transport.EnvTransport, "kafka")
	t.Setenv(transport.EnvKafkaBrokers, addr)
	t.Setenv(transport.EnvKafkaSASLMechanism, "PLAIN")
	t.Setenv(transport.EnvKafkaSASLUser, "svc")
	t.Setenv(transport.EnvKafkaSASLPassword, "hunter2")
	err := openFromEnv(t)
	msg := err.Error()
	require.Contains(t, msg, "SASL handshake", msg)
	require.Contains(t, msg, "listener mismatch", msg)
	require.Contains(t, msg, "from "+transport.EnvKafkaBrokers, msg)
	require.Contains(t, msg, "from "+transport.EnvKafkaSASLMechanism, msg)
	require.NotContains(t, msg, "run out of available brokers", msg)
}

// The same through a kafka:// URL in MILLWRIGHT_TRANSPORT: the error names
// MILLWRIGHT_TRANSPORT, where the brokers and SASL came from.
func TestSASLFromTheTransportURLNamesMillwrightTransport(t *testing.T) {
	addr := plaintextBroker(t)
	t.Setenv(transport.EnvTransport, "kafka://svc:hunter2@"+addr+"?sasl=SCRAM-SHA-256")
	err := openFromEnv(t)
	msg := err.Error()
	require.Contains(t, msg, "listener mismatch", msg)
	require.Contains(t, msg, "from "+transport.EnvTransport, msg)
	require.NotContains(t, msg, transport.EnvKafkaBrokers, msg)
}

// TLS against the PLAINTEXT listener: the broker closes the connection
// during the TLS handshake; the error says so, that the listener answers
// plaintext Kafka (a mismatch), and names MILLWRIGHT_KAFKA_TLS.
func TestTLSAgainstAPlaintextListenerSaysListenerMismatch(t *testing.T) {
	addr := plaintextBroker(t)
	t.Setenv(transport.EnvTransport, "kafka")
	t.Setenv(transport.EnvKafkaBrokers, addr)
	t.Setenv(transport.EnvKafkaTLS, "true")
	err := openFromEnv(t)
	msg := err.Error()
	require.Contains(t, msg, "TLS handshake", msg)
	require.Contains(t, msg, "listener mismatch", msg)
	require.Contains(t, msg, "from "+transport.EnvKafkaTLS, msg)
	require.Contains(t, msg, "from "+transport.EnvKafkaBrokers, msg)
	require.NotContains(t, msg, "run out of available brokers", msg)
}

// Set in code, the settings are named as Config fields.
func TestProgrammaticConfigNamesTheConfigField(t *testing.T) {
	t.Parallel()
	addr := plaintextBroker(t)
	cfg := transport.Config{Kind: transport.Kafka, WaitForBroker: transport.NoWait}
	cfg.Kafka.Brokers = []string{addr}
	cfg.Kafka.SASL = transport.KafkaSASL{Mechanism: "PLAIN", User: "svc", Password: "hunter2"}
	_, err := transport.Open(context.Background(), cfg)
	require.Error(t, err)
	msg := err.Error()
	require.Contains(t, msg, "from Config.Kafka.Brokers", msg)
	require.Contains(t, msg, "from Config.Kafka.SASL", msg)
	require.False(t, strings.Contains(msg, "MILLWRIGHT_"), msg)
	require.False(t, errors.Is(err, transport.ErrGaveUpWaiting))
}
