package debezium_test

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	cebinding "github.com/cloudevents/sdk-go/v2/binding"
	cespec "github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// TestDebeziumRecordsEqualRelayRecords relays the same outbox rows twice,
// by millwright's relay and by Debezium's outbox event router on Kafka
// Connect, into the same topic, and compares the two copies of every event
// as a plain Sarama consumer sees them (partition, key, headers, value)
// and as the CloudEvents SDK decodes them: they must be the same.
func TestDebeziumRecordsEqualRelayRecords(t *testing.T) {
	t.Parallel()
	e := setup(t, 6)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	require.NoError(t, storage.EnableCapture(ctx, e.q, e.name))
	_, err := storage.CreateCaptureSlot(ctx, e.q, e.name)
	require.NoError(t, err)

	tp := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	events := []outbox.Event{
		{Topic: e.topic, AggregateType: "order", AggregateID: "o-1", EventType: "order.created.v1", Payload: []byte(`{"order_id":"o-1",  "n": [1, 2]}`),
			Metadata: map[string]string{metadata.TraceParent: tp, metadata.TraceState: "k=v", "tenant": "acme"}},
		{Topic: e.topic, AggregateType: "order", AggregateID: "o-1", EventType: "order.paid.v1", Payload: []byte(`{"order_id":"o-1"}`), Source: "/billing"},
		{Topic: e.topic, AggregateID: "o-2", Payload: []byte(`{"signed": "as is"}`), RawPayload: true},
		{Topic: e.topic, AggregateID: "o-3", Payload: []byte{0, 1, 2, 0xff}, Metadata: map[string]string{metadata.EventDataContentType: "application/octet-stream"}},
		{Topic: e.topic, Payload: []byte(`"no aggregate"`)},
		{Topic: e.topic, AggregateType: "acct", AggregateID: "ü-4", Payload: []byte{}, RawPayload: true, Metadata: map[string]string{metadata.OrderingKey: "custom-key", "saga_id": "s1"}},
	}
	for i := range 20 {
		events = append(events, outbox.Event{Topic: e.topic, AggregateType: "acct", AggregateID: fmt.Sprintf("a-%d", i%7), EventType: "acct.moved",
			Payload: []byte(fmt.Sprintf(`{"i": %d, "pad": "%s"}`, i, strings.Repeat("x", i)))})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(e.schema.DB), events...))

	rel, err := relay.New(postgres.From(e.schema.DB), e.tr.Publisher(), relay.Config{})
	require.NoError(t, err)
	for published := 0; published < len(events); {
		n, err := rel.RunOnce(ctx)
		require.NoError(t, err)
		require.NoError(t, ctx.Err())
		published += n
	}
	k := e.consume(t)
	k.wait(ctx, t, len(events)) // the relay's copies first
	e.start(ctx, t)
	recs := k.wait(ctx, t, 2*len(events))
	require.Len(t, recs, 2*len(events), "one copy from each relay, nothing more")

	byID := map[string][]record{}
	for _, r := range recs {
		id := r.Headers[metadata.EventID]
		require.NotEmpty(t, id, "record without ce_id: %+v", r)
		byID[id] = append(byID[id], r)
	}
	require.Len(t, byID, len(events))
	for id, pair := range byID {
		require.Len(t, pair, 2, "event %s", id)
		relayed, captured := pair[0], pair[1]
		if relayed.Offset > captured.Offset { // the relay wrote first, on the same partition
			relayed, captured = captured, relayed
		}
		require.Equal(t, relayed.Partition, captured.Partition, "event %s: partition", id)
		require.Equal(t, relayed.Key, captured.Key, "event %s: key", id)
		require.Equal(t, relayed.Value, captured.Value, "event %s: value", id)
		require.Equal(t, relayed.Headers, captured.Headers, "event %s: headers (names %v vs %v)", id,
			slices.Sorted(maps.Keys(relayed.Headers)), slices.Sorted(maps.Keys(captured.Headers)))
		a, b := ceEvent(ctx, t, relayed), ceEvent(ctx, t, captured)
		require.Equal(t, a, b, "event %s: as the CloudEvents SDK reads it", id)
	}
	tps := 0
	for _, pair := range byID {
		if pair[0].Headers[metadata.TraceParent] == tp {
			tps++
		}
	}
	require.Equal(t, 1, tps, "the stored traceparent travels")
}

// ceEvent decodes r with the CloudEvents SDK's binary-mode binding
// machinery (the reader of transport/cloudevents_sdk_test.go) and returns
// the event's JSON form.
func ceEvent(ctx context.Context, t *testing.T, r record) string {
	t.Helper()
	w := wireMessage{prefix: "ce_", headers: r.Headers, body: r.Value, contentType: r.Headers["content-type"]}
	ev, err := cebinding.ToEvent(ctx, w)
	require.NoError(t, err)
	require.NoError(t, ev.Validate())
	b, err := ev.MarshalJSON()
	require.NoError(t, err)
	return string(b)
}

// wireMessage is a Kafka record in CloudEvents binary mode, read by the
// SDK's own binding machinery (a copy of transport's test reader: the
// SDK's Kafka binding is a module the proxy here does not serve).
type wireMessage struct {
	prefix, contentType string
	headers             map[string]string
	body                []byte
}

func (m wireMessage) version() cespec.Version {
	return cespec.WithPrefix(m.prefix).Version(m.headers[m.prefix+"specversion"])
}

func (m wireMessage) ReadEncoding() cebinding.Encoding {
	if m.version() != nil {
		return cebinding.EncodingBinary
	}
	return cebinding.EncodingUnknown
}

func (m wireMessage) ReadStructured(context.Context, cebinding.StructuredWriter) error {
	return cebinding.ErrNotStructured
}

func (m wireMessage) ReadBinary(ctx context.Context, w cebinding.BinaryWriter) error {
	v := m.version()
	if v == nil {
		return cebinding.ErrNotBinary
	}
	for _, k := range slices.Sorted(maps.Keys(m.headers)) {
		if !strings.HasPrefix(k, m.prefix) {
			continue
		}
		var err error
		if a := v.Attribute(k); a != nil {
			err = w.SetAttribute(a, m.headers[k])
		} else {
			err = w.SetExtension(strings.TrimPrefix(k, m.prefix), m.headers[k])
		}
		if err != nil {
			return fmt.Errorf("header %s: %w", k, err)
		}
	}
	if m.contentType != "" {
		if err := w.SetAttribute(v.AttributeFromKind(cespec.DataContentType), m.contentType); err != nil {
			return err
		}
	}
	return w.SetData(bytes.NewReader(m.body))
}

func (m wireMessage) Finish(error) error { return nil }

func (m wireMessage) GetAttribute(k cespec.Kind) (cespec.Attribute, any) {
	a := m.version().AttributeFromKind(k)
	if a == nil {
		return nil, nil
	}
	if k == cespec.DataContentType && m.contentType != "" {
		return a, m.contentType
	}
	if v, ok := m.headers[a.PrefixedName()]; ok {
		return a, v
	}
	return a, nil
}

func (m wireMessage) GetExtension(name string) any {
	if v, ok := m.headers[m.prefix+name]; ok {
		return v
	}
	return nil
}
