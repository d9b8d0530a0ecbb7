package logfields_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/metadata"
)

func TestOf(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("m-1", nil)
	msg.Metadata.Set(metadata.EventID, "e-1")
	msg.Metadata.Set(metadata.TraceParent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	require.Equal(t, watermill.LogFields{"message_uuid": "m-1", "event_id": "e-1", "topic": "orders", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"},
		logfields.Of("orders", msg))

	bare := message.NewMessage("m-2", nil)
	require.Equal(t, watermill.LogFields{"message_uuid": "m-2"}, logfields.Of("", bare), "only what is known")
}

func TestTraceRejectsMalformedIDs(t *testing.T) {
	t.Parallel()
	for _, tp := range []string{"", "garbage", "00-xyz-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01"} {
		msg := message.NewMessage("m", nil)
		msg.Metadata.Set(metadata.TraceParent, tp)
		require.Empty(t, logfields.Trace(msg), tp)
	}
}
