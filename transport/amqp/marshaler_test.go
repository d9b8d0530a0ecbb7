package amqp_test

import (
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport/amqp"
)

// Producers other than millwright may use the binding's native AMQP types
// and the older "cloudEvents_" prefix; the binding requires receivers to
// read both.
func TestUnmarshalNativeValuesAndOldPrefix(t *testing.T) {
	t.Parallel()
	ts := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	d := amqp091.Delivery{
		ContentType: "application/json",
		Headers: amqp091.Table{
			wamqp.DefaultMessageUUIDHeaderKey: "u1",
			"cloudEvents:time":                ts,
			"cloudEvents_id":                  "e1",
			"cloudEvents:sequence":            int64(42),
			"plain":                           "v",
		},
	}
	msg, err := amqp.Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, "u1", msg.UUID)
	require.Equal(t, "2026-03-04T05:06:07Z", msg.Metadata.Get(metadata.EventTime))
	require.Equal(t, "e1", msg.Metadata.Get(metadata.EventID))
	require.Equal(t, "42", msg.Metadata.Get("ce_sequence"))
	require.Equal(t, "application/json", msg.Metadata.Get(metadata.EventDataContentType))
	require.Equal(t, "v", msg.Metadata.Get("plain"))
	require.Len(t, msg.Metadata, 5)

	d.Headers["cloudEvents:subject"] = amqp091.Table{"nested": "x"}
	_, err = amqp.Marshaler{}.Unmarshal(d)
	require.ErrorContains(t, err, "cloudEvents:subject")
}
