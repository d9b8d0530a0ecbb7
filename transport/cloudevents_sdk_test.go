package transport_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	cebinding "github.com/cloudevents/sdk-go/v2/binding"
	cespec "github.com/cloudevents/sdk-go/v2/binding/spec"
	ceevent "github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
	tnats "github.com/millwright/millwright/transport/nats"
	"github.com/millwright/millwright/transport/transporttest"
)

// wireMessage is one message as a broker holds it, in CloudEvents binary
// mode: attributes in headers named prefix+attribute, datacontenttype in
// contentType. It is a cebinding.Message: the CloudEvents SDK's own
// binding machinery (cespec.WithPrefix, the spec tables every SDK protocol
// binding uses, and cebinding.ToEvent) reads it. The SDK's Kafka, AMQP and
// Pub/Sub protocol bindings are modules of their own that the Go module
// proxy here does not serve; Pub/Sub attributes are read with the SDK's
// HTTP binding, whose "ce-" headers and Content-Type are the Pub/Sub
// binding's names too.
type wireMessage struct {
	prefix      string
	contentType string
	headers     map[string]string
	body        []byte
}

var (
	_ cebinding.Message               = wireMessage{}
	_ cebinding.MessageMetadataReader = wireMessage{}
)

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
	for k, val := range m.headers {
		if !strings.HasPrefix(k, m.prefix) {
			continue
		}
		var err error
		if a := v.Attribute(k); a != nil {
			err = w.SetAttribute(a, val)
		} else {
			err = w.SetExtension(strings.TrimPrefix(k, m.prefix), val)
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

// TestOutboxEventsDecodeWithCloudEventsSDK writes two events exactly as
// outbox/doc.go shows (no Source; one with a RawPayload JSON body), relays
// them through each kind, reads them back as the broker holds them, and
// decodes and validates them with the CloudEvents Go SDK: every one must be
// a valid CloudEvents 1.0 event with the default source, the event id and
// the JSON content type.
func TestOutboxEventsDecodeWithCloudEventsSDK(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			schema := pgtest.New(t, outbox.Migrations())
			var cfg transport.Config
			if kind == transport.SQL {
				cfg = sqlConfig(schema.DB)
			} else {
				cfg = transporttest.Config(t, kind)
			}
			tr, err := transport.Open(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })
			topic := "cesdk_" + watermill.NewShortUUID()
			sub, err := tr.Subscriber("cegroup")
			require.NoError(t, err)
			consumed, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			switch kind {
			case transport.AMQP:
				bindRawQueue(t, cfg.AMQP.URL, topic)
			case transport.GoogleCloud:
				bindRawSubscription(t, cfg, topic)
			}

			events := []outbox.Event{
				{Topic: topic, AggregateType: "order", AggregateID: "o-1", EventType: "order.created.v1", Payload: []byte(`{"order_id":"o-1"}`)},
				{Topic: topic, AggregateID: "o-2", Payload: []byte(`{"signed": "as is"}`), RawPayload: true, ID: "raw-" + watermill.NewShortUUID()},
			}
			require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(schema.DB), events...))
			rel, err := relay.New(postgres.From(schema.DB), tr.Publisher(), relay.Config{})
			require.NoError(t, err)
			published := 0
			for published < len(events) {
				n, err := rel.RunOnce(ctx)
				require.NoError(t, err)
				require.NoError(t, ctx.Err(), "relay published %d of %d events", published, len(events))
				published += n
			}
			var fromSubscriber []cebinding.Message
			for range events { // the subscriber's copies, consumed and acked
				select {
				case m := <-consumed:
					m.Ack()
					fromSubscriber = append(fromSubscriber, wireMessage{prefix: "ce_", headers: m.Metadata, body: m.Payload})
				case <-ctx.Done():
					t.Fatalf("%s: event not consumed from %s", kind, topic)
				}
			}

			wire := fromSubscriber // gochannel has no wire
			if kind != transport.GoChannel {
				wire = readWire(ctx, t, kind, cfg, schema, topic, len(events))
			}
			require.Len(t, wire, len(events))
			byID := map[string]*ceevent.Event{}
			for i, w := range wire {
				ev, err := cebinding.ToEvent(ctx, w)
				require.NoError(t, err, "%s: message %d: the CloudEvents SDK cannot read it", kind, i)
				require.NoError(t, ev.Validate(), "%s: message %d: not a valid CloudEvent", kind, i)
				byID[ev.ID()] = ev
			}
			raw := byID[events[1].ID]
			require.NotNil(t, raw, "%s: the RawPayload event %s is not among %v", kind, events[1].ID, byID)
			require.Equal(t, events[1].Payload, raw.Data(), "RawPayload kept byte for byte")
			require.Equal(t, topic, raw.Type(), "EventType defaults to the topic")
			for _, ev := range byID {
				require.Equal(t, defaultSource(t), ev.Source(), "%s: event %s", kind, ev.ID())
				require.Equal(t, "1.0", ev.SpecVersion())
				require.Equal(t, "application/json", ev.DataContentType(), "%s: event %s", kind, ev.ID())
				require.False(t, ev.Time().IsZero())
				var body map[string]any
				require.NoError(t, json.Unmarshal(ev.Data(), &body))
			}
		})
	}
}

// readWire reads n messages of topic as the broker holds them.
func readWire(ctx context.Context, t *testing.T, kind transport.Kind, cfg transport.Config, schema *pgtest.Schema, topic string, n int) []cebinding.Message {
	t.Helper()
	var out []cebinding.Message
	switch kind {
	case transport.Kafka:
		cl, err := kgo.NewClient(kgo.SeedBrokers(cfg.Kafka.Brokers...), kgo.ConsumeTopics(topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		require.NoError(t, err)
		defer cl.Close()
		for len(out) < n {
			fs := cl.PollFetches(ctx)
			require.NoError(t, ctx.Err(), "read %d of %d records from Kafka topic %s", len(out), n, topic)
			fs.EachRecord(func(r *kgo.Record) {
				w := wireMessage{prefix: "ce_", headers: map[string]string{}, body: r.Value}
				for _, h := range r.Headers {
					w.headers[strings.ToLower(h.Key)] = string(h.Value)
				}
				w.contentType = w.headers["content-type"]
				out = append(out, w)
			})
		}
	case transport.AMQP:
		conn, err := amqp091.Dial(cfg.AMQP.URL)
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		for len(out) < n {
			d, ok, err := ch.Get(topic+"_raw", true)
			require.NoError(t, err)
			require.True(t, ok, "raw queue %s_raw has %d of %d messages", topic, len(out), n)
			w := wireMessage{prefix: "cloudEvents:", contentType: d.ContentType, headers: map[string]string{}, body: d.Body}
			for k, v := range d.Headers {
				if s, ok := v.(string); ok {
					w.headers[k] = s
				}
			}
			require.Equal(t, w.headers["cloudEvents:id"], d.MessageId, "message-id property is the event id")
			require.False(t, d.Timestamp.IsZero(), "timestamp property is set")
			out = append(out, w)
		}
	case transport.GoogleCloud:
		cl := rawPubSubClient(t, cfg)
		rctx, stop := context.WithCancel(ctx)
		defer stop()
		var got []*pubsub.Message
		var mu sync.Mutex // Receive calls the callback from several goroutines
		err := cl.Subscription(topic+"_raw").Receive(rctx, func(_ context.Context, m *pubsub.Message) {
			m.Ack()
			mu.Lock()
			defer mu.Unlock()
			if len(got) < n {
				got = append(got, m)
			}
			if len(got) == n {
				stop()
			}
		})
		require.NoError(t, err)
		require.Len(t, got, n, "messages read back from Pub/Sub subscription %s_raw", topic)
		for _, m := range got {
			h := http.Header{}
			for k, v := range m.Attributes {
				h.Set(k, v)
			}
			out = append(out, cehttp.NewMessage(h, io.NopCloser(bytes.NewReader(m.Data))))
		}
	case transport.NATS:
		// The stream as it holds the messages: their headers are the
		// CloudEvents NATS protocol binding's ("ce-<attr>", content-type).
		nc, err := natsgo.Connect(cfg.NATS.URL)
		require.NoError(t, err)
		defer nc.Close()
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		st, err := js.Stream(ctx, tnats.StreamName(topic))
		require.NoError(t, err)
		for seq := uint64(1); len(out) < n; seq++ {
			raw, err := st.GetMsg(ctx, seq)
			require.NoError(t, err, "message %d of stream %s", seq, tnats.StreamName(topic))
			w := wireMessage{prefix: "ce-", contentType: raw.Header.Get("content-type"), headers: map[string]string{}, body: raw.Data}
			for k, vs := range raw.Header {
				if k != "content-type" && len(vs) > 0 {
					w.headers[k] = vs[0]
				}
			}
			require.Equal(t, w.headers["ce-id"], raw.Header.Get("Nats-Msg-Id"), "Nats-Msg-Id is the event id")
			out = append(out, w)
		}
	case transport.SQL:
		// No CloudEvents binding exists for SQL: the row keeps the
		// metadata keys ("ce_<attr>", as Kafka's binding names them).
		rows, err := schema.DB.QueryContext(ctx, fmt.Sprintf(`SELECT payload, metadata FROM "watermill_%s"`, topic))
		require.NoError(t, err)
		defer rows.Close()
		for rows.Next() {
			var payload, raw []byte
			require.NoError(t, rows.Scan(&payload, &raw))
			w := wireMessage{prefix: "ce_", body: payload}
			require.NoError(t, json.Unmarshal(raw, &w.headers))
			out = append(out, w)
		}
		require.NoError(t, rows.Err())
	}
	return out
}

// defaultSource is the CloudEvents source of events written without one
// by outbox.Add: that of a Writer with the default settings.
func defaultSource(t *testing.T) string {
	w, err := outbox.NewWriter(outbox.WriterConfig{})
	require.NoError(t, err)
	return w.Source()
}
