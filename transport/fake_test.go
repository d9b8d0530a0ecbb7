package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/embedded" // the fakes, selected by MILLWRIGHT_TRANSPORT alone
)

// A new application selects the in-process development fakes by
// MILLWRIGHT_TRANSPORT alone, by name or by URL: Open starts the fake,
// a message makes the round trip, Close stops it.
func TestFakesSelectedByEnvironmentAlone(t *testing.T) {
	for _, sel := range []string{"kfake", "kfake://", "pstest", "pstest://millwright-try"} {
		t.Run(sel, func(t *testing.T) {
			t.Setenv(transport.EnvTransport, sel)
			cfg, err := transport.FromEnv()
			require.NoError(t, err)
			require.Contains(t, cfg.String(), "development fake")
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			tr, err := transport.Open(ctx, cfg)
			require.NoError(t, err)
			defer func() { require.NoError(t, tr.Close()) }()
			require.Contains(t, tr.String(), "development fake")
			sub, err := tr.Subscriber("try")
			require.NoError(t, err)
			topic := "fake_" + watermill.NewShortUUID()
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			sent := message.NewMessage(watermill.NewUUID(), []byte("hello"))
			require.NoError(t, tr.Publisher().Publish(topic, sent))
			select {
			case got := <-msgs:
				got.Ack()
				require.Equal(t, sent.UUID, got.UUID)
				require.Equal(t, "hello", string(got.Payload))
			case <-ctx.Done():
				t.Fatalf("%s: message not received within 60s", sel)
			}
		})
	}
}

// Addresses that cannot work are refused at configuration time, with the
// fix in the message.
func TestUnusableAddressesAreRefused(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string][]string{
		"kafka://:9092":          {"no host", "127.0.0.1:9092"},
		"kafka://h:0":            {"port", "1 to 65535"},
		"kafka://h:x":            {"port", "1 to 65535"},
		"mem://x":                {"mem://", "no host or path"},
		"gochannel://x/y":        {"mem://"},
		"kfake://127.0.0.1:9092": {"no address", "kafka://host:9092"},
		"pstest://p/x":           {"pstest://PROJECT"},
	} {
		_, err := transport.ParseURL(raw)
		require.Error(t, err, raw)
		for _, w := range want {
			require.ErrorContains(t, err, w, raw)
		}
	}
	for _, ok := range []string{"mem://", "mem:///", "kfake://", "pstest://", "kafka://[::1]:9092"} {
		_, err := transport.ParseURL(ok)
		require.NoError(t, err, ok)
	}
}

func TestFakeWithRealAddressIsRefused(t *testing.T) {
	t.Setenv(transport.EnvTransport, "kfake")
	t.Setenv(transport.EnvKafkaBrokers, "127.0.0.1:9092")
	_, err := transport.FromEnv()
	require.ErrorContains(t, err, "unset MILLWRIGHT_KAFKA_BROKERS")

	t.Setenv(transport.EnvTransport, "pstest")
	t.Setenv(transport.EnvPubSubEmulatorHost, "127.0.0.1:8085")
	_, err = transport.FromEnv()
	require.ErrorContains(t, err, "unset MILLWRIGHT_PUBSUB_EMULATOR_HOST")

	t.Setenv(transport.EnvTransport, "kafka")
	t.Setenv(transport.EnvKafkaBrokers, ":9092")
	_, err = transport.FromEnv()
	require.ErrorContains(t, err, "no host")
}
