package transport_test

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// hostileNames are refused as topics and groups on every kind.
var hostileNames = []string{
	``,
	`orders"; DROP TABLE millwright_outbox; --`,
	`orders'; DELETE FROM pg_class; --`,
	`../../etc/passwd`,
	`orders/../../x`,
	`orders with spaces`,
	"orders\x00nul",
	"orders\nnewline",
	`orders$1`,
	`amq.direct/../x`,
	`-leading-dash`,
	strings.Repeat("a", 300),
}

func TestHostileNamesAreRefusedOnEveryKind(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			tr := transporttest.Open(t, kind)
			sub, err := tr.Subscriber("names-test")
			require.NoError(t, err)
			for _, name := range hostileNames {
				err := tr.Publisher().Publish(name, message.NewMessage("1", []byte("{}")))
				require.ErrorIs(t, err, transport.ErrInvalidName, "publish to %q", name)

				_, err = sub.Subscribe(context.Background(), name)
				require.ErrorIs(t, err, transport.ErrInvalidName, "subscribe to %q", name)

				if name != "" {
					_, err = tr.Subscriber(name)
					require.ErrorIs(t, err, transport.ErrInvalidName, "group %q", name)
				}
				if si, ok := sub.(message.SubscribeInitializer); ok {
					require.ErrorIs(t, si.SubscribeInitialize(name), transport.ErrInvalidName, "initialize %q", name)
				}
			}
		})
	}
}

func TestValidateName(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"orders", "order.created.v1", "orders_dlq", "a-b", "Orders2"} {
		for _, kind := range transport.Kinds {
			require.NoError(t, transport.ValidateName(kind, "topic", ok), "%s on %s", ok, kind)
		}
	}
	require.Error(t, transport.ValidateName(transport.GoogleCloud, "topic", "1orders"), "Pub/Sub names start with a letter")
	require.Error(t, transport.ValidateName(transport.GoogleCloud, "topic", "ab"), "Pub/Sub names have 3 characters")
	require.Error(t, transport.ValidateName(transport.SQL, "topic", strings.Repeat("t", 46)), "Postgres identifiers are 63 bytes with the prefix")
	require.NoError(t, transport.ValidateName(transport.Kafka, "topic", strings.Repeat("t", 46)))
}
