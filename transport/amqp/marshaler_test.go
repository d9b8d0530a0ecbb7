package amqp_test

import (
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
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

// Readers that know nothing of CloudEvents look at the AMQP properties:
// message-id is the event id, timestamp the event time, content-type the
// datacontenttype.
func TestMarshalSetsMessageProperties(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("u1", []byte(`{}`))
	msg.Metadata.Set(metadata.EventID, "evt-1")
	msg.Metadata.Set(metadata.EventTime, "2026-03-04T05:06:07.5Z")
	msg.Metadata.Set(metadata.EventDataContentType, "application/json")
	p, err := amqp.Marshaler{}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, "evt-1", p.MessageId)
	require.Equal(t, "application/json", p.ContentType)
	require.True(t, p.Timestamp.Equal(time.Date(2026, 3, 4, 5, 6, 7, 500000000, time.UTC)), "timestamp %v", p.Timestamp)
	require.NotContains(t, p.Headers, "cloudEvents:datacontenttype")

	// Without CloudEvents metadata: the Watermill UUID, the publish time.
	before := time.Now()
	p, err = amqp.Marshaler{}.Marshal(message.NewMessage("u2", nil))
	require.NoError(t, err)
	require.Equal(t, "u2", p.MessageId)
	require.False(t, p.Timestamp.Before(before.Add(-time.Second)), "timestamp %v", p.Timestamp)
}
