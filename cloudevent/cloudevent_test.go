package cloudevent_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
)

func TestBindingKeys(t *testing.T) {
	t.Parallel()
	cases := []struct {
		b              cloudevent.Binding
		md, wire       string
		extraWireNames []string // also decode to md
	}{
		{cloudevent.Kafka, metadata.EventID, "ce_id", nil},
		{cloudevent.Kafka, metadata.EventDataContentType, "content-type", nil},
		{cloudevent.Kafka, metadata.OrderingKey, metadata.OrderingKey, nil},
		{cloudevent.AMQP, metadata.EventSource, "cloudEvents:source", []string{"cloudEvents_source"}},
		{cloudevent.AMQP, metadata.EventDataContentType, "", nil},
		{cloudevent.AMQP, metadata.TraceParent, metadata.TraceParent, nil},
		{cloudevent.PubSub, metadata.EventTime, "ce-time", []string{"CE-Time"}},
		{cloudevent.PubSub, metadata.EventDataContentType, "Content-Type", []string{"content-type", "ce-datacontenttype"}},
		{cloudevent.PubSub, "ce_myext", "ce-myext", nil},
	}
	for _, c := range cases {
		require.Equal(t, c.wire, c.b.WireKey(c.md), "WireKey(%s) with prefix %s", c.md, c.b.Prefix)
		if c.wire != "" {
			require.Equal(t, c.md, c.b.MetadataKey(c.wire), "MetadataKey(%s)", c.wire)
		}
		for _, w := range c.extraWireNames {
			require.Equal(t, c.md, c.b.MetadataKey(w), "MetadataKey(%s)", w)
		}
	}
}

func TestDecodeContentTypeWins(t *testing.T) {
	t.Parallel()
	for i := 0; i < 20; i++ { // map order is random: repeat
		md := map[string]string{"ce-datacontenttype": "text/plain", "Content-Type": "application/json", "ce-id": "1", "x": "y"}
		cloudevent.PubSub.Decode(md)
		require.Equal(t, map[string]string{metadata.EventDataContentType: "application/json", metadata.EventID: "1", "x": "y"}, md)
	}
}

func validMessage() *message.Message {
	msg := message.NewMessage("m1", []byte(`{}`))
	cloudevent.Attributes{
		ID: "e1", Source: "/orders", Type: "order.created.v1",
		Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Subject: "order-42", DataContentType: "application/json",
	}.Apply(msg)
	return msg
}

func TestValidate(t *testing.T) {
	t.Parallel()
	a, err := cloudevent.FromMessage(validMessage())
	require.NoError(t, err)
	require.Equal(t, "1.0", a.SpecVersion)
	require.Equal(t, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), a.Time)

	bad := []struct {
		key, value, want string
	}{
		{metadata.EventID, "", "ce_id is missing"},
		{metadata.EventSpecVersion, "0.3", `want "1.0"`},
		{metadata.EventTime, "yesterday", "RFC 3339"},
		{metadata.EventDataContentType, "json", "not a media type"},
		{metadata.EventSource, "http://[::1", "not a URI-reference"},
		{metadata.EventSubject, "", "ce_subject is empty"},
	}
	for _, b := range bad {
		msg := validMessage()
		msg.Metadata.Set(b.key, b.value)
		err := cloudevent.Validate(msg)
		require.ErrorContains(t, err, b.want, "%s=%q", b.key, b.value)
	}
	msg := message.NewMessage("m2", nil)
	err = cloudevent.Validate(msg)
	for _, k := range []string{metadata.EventID, metadata.EventSource, metadata.EventType, metadata.EventSpecVersion} {
		require.ErrorContains(t, err, k)
	}
}

func TestParseType(t *testing.T) {
	t.Parallel()
	name, v, ok := cloudevent.ParseType(cloudevent.Type("order.created", 12))
	require.True(t, ok)
	require.Equal(t, "order.created", name)
	require.Equal(t, 12, v)
	for _, bad := range []string{"order.created", "order.created.v0", "order.created.v01", ".v1", "order.created.vx"} {
		_, _, ok := cloudevent.ParseType(bad)
		require.False(t, ok, bad)
	}
}

func TestVersionRouter(t *testing.T) {
	t.Parallel()
	var got []string
	r := cloudevent.NewVersionRouter().
		Handle("order.created.v1", func(*message.Message) error { got = append(got, "v1"); return nil }).
		Handle("order.created.v2", func(*message.Message) error { got = append(got, "v2"); return nil })
	h := r.Handler()
	for _, typ := range []string{"order.created.v2", "order.created.v1"} {
		msg := message.NewMessage("m", nil)
		msg.Metadata.Set(metadata.EventType, typ)
		require.NoError(t, h(msg))
	}
	require.Equal(t, []string{"v2", "v1"}, got)

	msg := message.NewMessage("m3", nil)
	msg.Metadata.Set(metadata.EventType, "order.created.v3")
	err := h(msg)
	require.True(t, errors.Is(err, cloudevent.ErrUnknownType))
	require.True(t, failure.IsPermanent(err), "unknown versions must go to the DLQ, not be retried")
	require.ErrorContains(t, err, "order.created.v3")

	fell := false
	r.Fallback(func(*message.Message) error { fell = true; return nil })
	require.NoError(t, r.Handler()(msg))
	require.True(t, fell)
}

// Issue 40 (a value whose text form loses information): a time.Time that
// RFC 3339 cannot write (a year past 9999 or before 0000) is written by
// Apply as text no reader parses; Validate, which outbox.Add runs, refuses
// it naming the metadata key, so it never reaches a consumer.
func TestApplyOfATimeRFC3339CannotHoldIsRefusedByValidate(t *testing.T) {
	t.Parallel()
	for _, tm := range []time.Time{
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC),
	} {
		msg := message.NewMessage("id-1", nil)
		cloudevent.Attributes{ID: "e-1", Source: "/orders", Type: "com.example.order.placed", Time: tm}.Apply(msg)
		err := cloudevent.Validate(msg)
		require.Error(t, err, "year %d", tm.Year())
		require.Contains(t, err.Error(), metadata.EventTime)
	}
	// The extremes RFC 3339 holds round-trip exactly.
	for _, tm := range []time.Time{
		time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Date(2026, 1, 2, 3, 4, 5, 6, time.FixedZone("", 23*3600)),
	} {
		msg := message.NewMessage("id-1", nil)
		cloudevent.Attributes{ID: "e-1", Source: "/orders", Type: "com.example.order.placed", Time: tm}.Apply(msg)
		a, err := cloudevent.FromMessage(msg)
		require.NoError(t, err)
		require.True(t, a.Time.Equal(tm), "%v read back as %v", tm, a.Time)
	}
}
