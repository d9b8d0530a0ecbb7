package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	trace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// Values are written as quoted literals: awkward content must round-trip
// exactly, and what Postgres cannot store must be refused by name.
func TestAdd_AwkwardValuesRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "its")
	ctx := context.Background()
	tricky := `x'); DROP TABLE millwright_outbox; -- \ \\ "` + "é\u2028"
	evs := []outbox.Event{
		{Topic: "its", AggregateID: tricky, Payload: []byte(`{"s": "` + `\\'` + `"}`), Metadata: map[string]string{"k'\\": tricky}},
		{Topic: "its", AggregateID: "a", Payload: []byte(`{"nul": "\u0000"}`)},                  // JSON that JSONB refuses: kept as bytes
		{Topic: "its", AggregateID: "a", Payload: []byte{0, 1, 2, '\\', '\'', 0xff}},            // binary
		{Topic: "its", AggregateID: "a", Payload: []byte(` {"spaced" : 1} `), RawPayload: true}, // byte-exact JSON
		{Topic: "its", AggregateID: "a", Payload: []byte(`{"n": 1e131072}`)},                    // beyond numeric: kept as bytes
		{Topic: "its", AggregateID: "a", Payload: []byte(`{"s": "\ud800"}`)},                    // a lone surrogate: kept as bytes
	}
	for i := range evs {
		evs[i].ID = fmt.Sprint("ev-", i)
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	startRelay(t, b.db, b.pubsub, Config{PollInterval: 10 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == len(evs) }, "%d messages", len(evs))
	// Different aggregates go out in parallel: look messages up by id.
	byID := map[string]*message.Message{}
	for _, m := range got.all() {
		byID[m.UUID] = m
	}
	msgs := make([]*message.Message, len(evs))
	for i := range evs {
		msgs[i] = byID[evs[i].ID]
		require.NotNil(t, msgs[i], evs[i].ID)
	}
	require.Equal(t, tricky, msgs[0].Metadata.Get(metadata.AggregateID))
	require.Equal(t, tricky, msgs[0].Metadata.Get("k'\\"))
	require.JSONEq(t, string(evs[0].Payload), string(msgs[0].Payload))
	for i := 1; i < len(evs); i++ {
		require.Equal(t, evs[i].Payload, []byte(msgs[i].Payload), "payload %d byte for byte", i)
	}

	err := outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a", Metadata: map[string]string{"k": "a\x00b"}})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorContains(t, err, "NUL")
	require.ErrorIs(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t\x00", AggregateID: "a"}), outbox.ErrInvalidEvent)
}

// The metadata column keeps only what the other columns do not say; the
// published message still carries the full CloudEvents metadata, derived
// from the row, with the event's own metadata winning (except the id).
func TestAdd_PublishedMetadataIsCompleteAndStoredOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "orders")
	ctx := context.Background()
	tp := trace.NewTracerProvider()
	ctx, span := tp.Tracer("test").Start(ctx, "write")
	sc := span.SpanContext()
	span.End()
	before := time.Now()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db),
		outbox.Event{ID: "e-1", Topic: "orders", AggregateType: "order", AggregateID: "o-1", EventType: "order.created.v1", Source: "/orders",
			Payload: []byte(`{"a":1}`), Metadata: map[string]string{"tenant": "t-1", metadata.EventSubject: "custom", metadata.EventID: "forged"}}))
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(b.db), outbox.Event{ID: "e-2", Topic: "orders", Payload: []byte("bytes")}))
	var stored string
	require.NoError(t, b.db.QueryRow(`SELECT metadata::text FROM millwright_outbox WHERE event_id = 'e-1'`).Scan(&stored))
	require.JSONEq(t, `{"tenant":"t-1","ce_subject":"custom","ce_source":"/orders","traceparent":"00-`+sc.TraceID().String()+`-`+sc.SpanID().String()+`-01"}`, stored)
	require.NoError(t, b.db.QueryRow(`SELECT metadata::text FROM millwright_outbox WHERE event_id = 'e-2'`).Scan(&stored))
	require.JSONEq(t, `{"ce_source":"`+defaultSource(t)+`"}`, stored, "only the default source, which no column holds")

	startRelay(t, b.db, b.pubsub, Config{PollInterval: 10 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 2 }, "2 messages")
	byID := map[string]message.Metadata{}
	for _, m := range got.all() {
		byID[m.UUID] = m.Metadata
	}
	m1 := byID["e-1"]
	at, err := time.Parse(time.RFC3339Nano, m1.Get(metadata.EventTime))
	require.NoError(t, err)
	require.WithinDuration(t, before, at, 5*time.Second)
	delete(m1, metadata.EventTime)
	require.Equal(t, message.Metadata{
		metadata.EventID: "e-1", metadata.EventSpecVersion: "1.0", metadata.EventSource: "/orders", metadata.EventType: "order.created.v1",
		metadata.EventSubject: "custom", metadata.EventDataContentType: "application/json",
		metadata.AggregateType: "order", metadata.AggregateID: "o-1", metadata.OrderingKey: "order/o-1",
		metadata.TraceParent: "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01", "tenant": "t-1",
	}, m1)
	m2 := byID["e-2"]
	require.NotEmpty(t, m2.Get(metadata.EventTime))
	delete(m2, metadata.EventTime)
	require.Equal(t, message.Metadata{
		metadata.EventID: "e-2", metadata.EventSpecVersion: "1.0", metadata.EventSource: defaultSource(t), metadata.EventType: "orders",
		metadata.EventSubject: "e-2", metadata.AggregateID: "e-2", metadata.OrderingKey: "e-2",
	}, m2)
}

// A TxPublisher message carries its CloudEvents metadata in full: what the
// row's columns give is not stored twice, and the consumer gets exactly
// what was sent (plus the id and content type the outbox fills in).
func TestTxPublisher_StoresMetadataOnceAndDeliversItUnchanged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "orders")
	ctx := context.Background()
	msg := message.NewMessage("e-9", []byte(`{"a":1}`))
	sent := map[string]string{
		metadata.EventType: "order.created.v1", metadata.EventSpecVersion: "1.0", metadata.EventSubject: "o-1",
		metadata.AggregateType: "order", metadata.AggregateID: "o-1", metadata.OrderingKey: "order/o-1",
		metadata.EventTime: "2026-01-02T03:04:05Z", metadata.EventSource: "/orders", "tenant": "t-1",
	}
	for k, v := range sent {
		msg.Metadata.Set(k, v)
	}
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	pub, err := outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", msg))
	require.NoError(t, tx.Commit())
	var stored string
	require.NoError(t, b.db.QueryRow(`SELECT metadata::text FROM millwright_outbox WHERE event_id = 'e-9'`).Scan(&stored))
	require.JSONEq(t, `{"ce_time":"2026-01-02T03:04:05Z","ce_source":"/orders","tenant":"t-1"}`, stored)

	startRelay(t, b.db, b.pubsub, Config{PollInterval: 10 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "1 message")
	want := message.Metadata{metadata.EventID: "e-9", metadata.EventDataContentType: "application/json"}
	for k, v := range sent {
		want[k] = v
	}
	require.Equal(t, want, got.all()[0].Metadata)
}

// Rows written before the metadata column was trimmed carry their full
// metadata; the relay publishes it as it was written.
func TestRowMessage_RowOfAnEarlierVersionKeepsItsMetadata(t *testing.T) {
	t.Parallel()
	old := `{"ce_id":"e-1","ce_specversion":"1.0","ce_time":"2026-01-02T03:04:05.123456789Z","ce_subject":"o-1",` +
		`"aggregate_id":"o-1","aggregate_type":"order","ordering_key":"order/o-1","ce_type":"order.created.v1","ce_datacontenttype":"application/json"}`
	msg, err := rowMessage(storedRow{eventID: "e-1", aggType: "order", aggID: "o-1", eventType: "order.created.v1",
		payload: sql.NullString{String: `{"a":1}`, Valid: true}, metadata: old, createdAt: time.Date(2026, 1, 2, 3, 4, 6, 0, time.UTC)})
	require.NoError(t, err)
	var want message.Metadata
	require.NoError(t, json.Unmarshal([]byte(old), &want))
	require.Equal(t, want, msg.Metadata)
}

func countOrders(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n))
	return n
}

// defaultSource is the CloudEvents source outbox.Add gives events written
// without one: that of a Writer with the default settings.
func defaultSource(t *testing.T) string {
	w, err := outbox.NewWriter(outbox.WriterConfig{})
	require.NoError(t, err)
	return w.Source()
}
