package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// newWriter returns a Writer of cfg.
func newWriter(t *testing.T, cfg outbox.WriterConfig) *outbox.Writer {
	t.Helper()
	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	return w
}

// addIn writes events with w in a transaction of db, committed when w
// takes them. It returns every error (it runs in goroutines too).
func addIn(ctx context.Context, db *sql.DB, w *outbox.Writer, events ...outbox.Event) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := w.Add(ctx, postgres.SQLTx(tx), events...); err != nil {
		return errors.Join(err, tx.Rollback())
	}
	return tx.Commit()
}

// capturePublisher keeps a copy of the last message it forwards.
type capturePublisher struct {
	message.Publisher
	mu   sync.Mutex
	last *message.Message
}

func (p *capturePublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	p.last = msgs[len(msgs)-1].Copy()
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

// An event exactly at the limit of the relay's transport, counted as that
// kind counts a message on the wire (payload, key, headers or attributes,
// the CloudEvents metadata the relay adds; RabbitMQ: the body), is stored,
// relayed and received; one byte more is refused by Add, naming the limit
// and the setting. On Kafka and Pub/Sub the client library's own check agrees to
// the byte: the relayed message with one byte more is refused by Sarama
// (Producer.MaxMessageBytes) or the Pub/Sub client, permanently.
func TestAdd_EventAtTheWireLimitPublishesOneByteMoreIsRefused(t *testing.T) {
	t.Parallel()
	for _, kind := range []transport.Kind{transport.Kafka, transport.GoogleCloud, transport.AMQP, transport.SQL} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			wireLimit(t, kind)
		})
	}
}

func wireLimit(t *testing.T, kind transport.Kind) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := pgtest.New(t, outbox.Migrations())
	tr, err := transport.Open(ctx, transporttest.Config(t, kind))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	w, limits, setting := wireLimitsOf(t, tr, kind)
	max := w.Limits().MaxBytes

	topic := "size_" + watermill.NewShortUUID()
	received := subscribeSizeTopic(ctx, t, tr, kind, topic)

	// A stored traceparent and ce_time: the relay then sends exactly what
	// Add counted (without them Add counts the longest it may add).
	tctx := trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled}))
	atLimit := largestAccepted(tctx, t, s.DB, w, topic, max)

	require.NoError(t, addIn(tctx, s.DB, w, sizeEvent(topic, atLimit)), "an event at the limit is stored")

	capture := &capturePublisher{Publisher: tr.Publisher()}
	rel, err := relay.New(postgres.From(s.DB), capture, relay.Config{PollInterval: 20 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxAttempts: 3}})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- rel.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, rel.Close())
		require.NoError(t, <-done)
	})
	select {
	case msg := <-received:
		msg.Ack()
		require.Len(t, msg.Payload, atLimit)
	case <-time.After(45 * time.Second):
		var status, lastErr string
		_ = s.DB.QueryRow(`SELECT status, coalesce(last_error, '') FROM millwright_outbox`).Scan(&status, &lastErr)
		t.Fatalf("the event at the limit did not arrive on %s: row %s, last error %q", kind, status, lastErr)
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)))

	err = addIn(tctx, s.DB, w, sizeEvent(topic, atLimit+1))
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	require.ErrorContains(t, err, "is "+strconv.Itoa(max+1)+" bytes on the wire of "+string(kind))
	require.ErrorContains(t, err, "over the limit of "+strconv.Itoa(max))
	require.ErrorContains(t, err, setting)
	require.ErrorContains(t, err, "outbox.WriterConfig{Limits:")
	capture.mu.Lock()
	sent := capture.last
	capture.mu.Unlock()
	require.Equal(t, max, limits.Size(topic, sent.UUID, sent.Payload, sent.Metadata), "Add counted the message the relay sent")
	if kind == transport.SQL || kind == transport.AMQP {
		return // RabbitMQ 3.x takes 128 MiB; the sql transport 1 GiB
	}
	requireClientRefusesOneByteMore(t, tr, topic, sent)
}

// wireLimitsOf checks tr's limits for kind and returns a Writer of them,
// the limits and the setting the Writer's errors name.
func wireLimitsOf(t *testing.T, tr *transport.Transport, kind transport.Kind) (*outbox.Writer, transport.Limits, string) {
	limits := tr.Limits()
	setting := limits.Setting
	switch kind {
	case transport.Kafka:
		require.Equal(t, transport.KafkaMaxMessageBytes, limits.MaxBytes)
	case transport.GoogleCloud:
		require.Equal(t, transport.GoogleCloudMaxMessageBytes, limits.MaxBytes)
	case transport.AMQP:
		require.Equal(t, transport.AMQPMaxMessageBytes, limits.MaxBytes)
	}
	cfg := outbox.WriterConfig{Limits: limits}
	if kind == transport.SQL {
		// 1 GiB is the sql transport's limit; a lower MaxEventBytes
		// checks the counting and names itself.
		cfg.MaxEventBytes = 64 << 10
		setting = "outbox.WriterConfig.MaxEventBytes"
	}
	return newWriter(t, cfg), limits, setting
}

// subscribeSizeTopic subscribes group size-test to topic.
func subscribeSizeTopic(ctx context.Context, t *testing.T, tr *transport.Transport, kind transport.Kind, topic string) <-chan *message.Message {
	if kind == transport.AMQP {
		transporttest.DeleteAMQPTopology(t, []string{topic}, "size-test")
	}
	sub, err := tr.Subscriber("size-test")
	require.NoError(t, err)
	if si, ok := sub.(message.SubscribeInitializer); ok {
		require.NoError(t, si.SubscribeInitialize(topic))
	}
	received, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return received
}

// sizeEvent is an event to topic with a payload of n bytes.
func sizeEvent(topic string, n int) outbox.Event {
	return outbox.Event{Topic: topic, AggregateType: "order", AggregateID: "o-1", EventType: "size.v1",
		ID: "0d9b8f3e-6f0a-4c57-9b55-3e4f1c2a7b10", Payload: bytes.Repeat([]byte("x"), n),
		Metadata: map[string]string{metadata.EventTime: "2026-12-03T09:00:00.123456Z"}}
}

// largestAccepted is the largest payload Add takes (the metadata takes
// less than 4 KiB), found by bisection in rolled back transactions.
func largestAccepted(tctx context.Context, t *testing.T, db *sql.DB, w *outbox.Writer, topic string, max int) int {
	accepts := func(n int) bool {
		tx, err := db.BeginTx(tctx, nil)
		require.NoError(t, err)
		defer tx.Rollback() //nolint:errcheck // probe only
		return w.Add(tctx, postgres.SQLTx(tx), sizeEvent(topic, n)) == nil
	}
	lo, hi := max-4096, max+1 // accepts(lo), !accepts(hi)
	require.True(t, accepts(lo), "a payload of %d bytes", lo)
	require.False(t, accepts(hi), "a payload over the limit")
	for hi-lo > 1 {
		if mid := (lo + hi) / 2; accepts(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// requireClientRefusesOneByteMore: the transport's client refuses sent
// with one byte more, permanently.
func requireClientRefusesOneByteMore(t *testing.T, tr *transport.Transport, topic string, sent *message.Message) {
	over := message.NewMessage(sent.UUID, append(bytes.Clone(sent.Payload), 'x'))
	for k, v := range sent.Metadata {
		over.Metadata.Set(k, v)
	}
	err := tr.Publisher().Publish(topic, over)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge, "the client refuses one byte more: %v", err)
	require.True(t, failure.IsPermanent(err), "%v", err)
}

// Add refuses a topic that the relay's transport refuses, whichever it
// is: with the default Writer (Add), names that no kind takes; with a
// Writer of a kind's limits, the kind's rule (Pub/Sub: 3 characters or
// more, starting with a letter). With Pub/Sub's limits, a metadata value
// too long for an attribute is refused too.
func TestAdd_RefusesWhatTheTransportRefuses(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx := context.Background()
	for _, bad := range []string{"bad topic/ü", "-orders", "orders;drop", strings.Repeat("t", 256)} {
		err := outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: bad, Payload: []byte(`{}`)})
		require.ErrorIs(t, err, outbox.ErrInvalidEvent, "%q", bad)
		require.ErrorIs(t, err, transport.ErrInvalidName, "%q", bad)
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "ab", Payload: []byte(`{}`)}), "some kind takes it")

	w := newWriter(t, outbox.WriterConfig{Limits: transport.LimitsFor(transport.Config{Kind: transport.GoogleCloud})})
	err := addIn(ctx, s.DB, w, outbox.Event{Topic: "ab", Payload: []byte(`{}`)})
	require.ErrorIs(t, err, transport.ErrInvalidName)
	require.ErrorContains(t, err, "Pub/Sub names have at least 3 characters")
	err = addIn(ctx, s.DB, w, outbox.Event{Topic: "orders", Payload: []byte(`{}`), Metadata: map[string]string{"note": strings.Repeat("n", 1025)}})
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	require.ErrorContains(t, err, `metadata "note" is 1025 bytes`)
	require.NoError(t, addIn(ctx, s.DB, w, outbox.Event{Topic: "orders", Payload: []byte(`{}`), Metadata: map[string]string{"note": strings.Repeat("n", 1024)}}))
	require.Zero(t, countRows(t, s, "topic = 'ab'")-1, "only the first ab event was stored")
}

func countRows(t *testing.T, s *pgtest.Schema, where string) int {
	t.Helper()
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+where).Scan(&n))
	return n
}
