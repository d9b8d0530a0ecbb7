package relay_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/tracing"
	tsql "github.com/millwright/millwright/transport/sql"
)

// publisherOnly hides every optional ability of a publisher: the relay
// publishes through Publish.
type publisherOnly struct{ message.Publisher }

// inDatabaseFixture is an outbox and a Postgres transport on the same
// database (the transport adopts the outbox's pool).
func inDatabaseFixture(t *testing.T) (*pgtest.Schema, *tsql.Transport) {
	t.Helper()
	s := pgtest.New(t, outbox.Migrations())
	tr, err := tsql.Open(context.Background(), tsql.Config{DB: s.DB, PollInterval: 10 * time.Millisecond}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return s, tr
}

// receive reads n messages of topic from the transport.
func receive(t *testing.T, ctx context.Context, tr *tsql.Transport, topic string, n int) []*message.Message {
	t.Helper()
	sub, err := tr.Subscriber("test")
	require.NoError(t, err)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var out []*message.Message
	for len(out) < n {
		select {
		case m := <-ch:
			m.Ack()
			out = append(out, m)
		case <-ctx.Done():
			t.Fatalf("topic %s: received %d of %d messages: %v", topic, len(out), n, ctx.Err())
		}
	}
	return out
}

// movedInOneTransaction counts the messages of topic whose outbox row was
// marked published by the transaction that inserted the message.
func movedInOneTransaction(t *testing.T, db *sql.DB, topic string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "watermill_`+topic+`" w
		JOIN millwright_outbox o ON o.event_id = w.uuid
		WHERE o.status = 'published' AND o.xmin::text::bigint = (w.transaction_id::text::numeric % 4294967296)::bigint`).Scan(&n))
	return n
}

// TestInDatabasePublishSendsWhatThePublisherSends writes the same events,
// of every shape a row can have, for two topics on a Postgres transport
// sharing the outbox's database: one relay publishes them in the database
// (INSERT ... SELECT in the transaction that marks them), the other
// through Publish. The consumer must get the same payload and metadata
// from both, and only the first may publish and mark in one transaction.
// It runs on each driver of the matrix: the relays on a *sql.DB or a
// *pgxpool.Pool (the in-database publish's transaction is then pgx's).
func TestInDatabasePublishSendsWhatThePublisherSends(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		inDatabaseSendsWhatThePublisherSends(t, driver)
	})
}

func inDatabaseSendsWhatThePublisherSends(t *testing.T, driver string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, tr := inDatabaseFixture(t)
	h := s.Handle(t, driver)
	inDB, viaPublish := "indb_"+watermill.NewShortUUID(), "pub_"+watermill.NewShortUUID()

	shapes := []outbox.Event{
		{AggregateType: "order", AggregateID: "o-1", EventType: "order.created.v1", Payload: []byte(`{"n": 1, "b": [true, null]}`)},
		{AggregateID: "o-2", Payload: []byte("not json \x00\xff bytes")},
		{AggregateType: "order", AggregateID: `o-"3"\ é ✓`, EventType: `type "quoted"`, Payload: []byte(`{"n":3}`), RawPayload: true},
		{AggregateType: "order", AggregateID: "o-4", Payload: []byte(`{"n":4}`), Source: "/orders",
			Metadata: map[string]string{"tenant": `a"b\c é`, metadata.TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}},
		{AggregateType: "order", AggregateID: "o-5", EventType: "order.created.v1", Payload: []byte(`{"n":5}`),
			Metadata: map[string]string{metadata.EventType: "overridden.v2", metadata.OrderingKey: "custom-key", "x": "y"}},
		{AggregateType: "order", AggregateID: "o-6", Payload: []byte("[1,   2.50, \"\\u00e9\"]")},
		{AggregateType: "order", AggregateID: "o-7", Payload: []byte(`{}`), Metadata: map[string]string{metadata.OrderingKey: "", "y": ""}},
	}
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	for i, ev := range shapes {
		for _, topic := range []string{inDB, viaPublish} {
			e := ev
			e.Topic, e.ID = topic, fmt.Sprintf("%s-%d", topic, i)
			require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), e), "shape %d", i)
		}
	}
	require.NoError(t, tx.Commit())
	// The first relay takes only inDB's rows (the others are set aside
	// meanwhile), the second the rest.
	moved, err := relayOn(h, tr.Publisher(), relay.Config{})
	require.NoError(t, err)
	published, err := relayOn(h, publisherOnly{tr.Publisher()}, relay.Config{})
	require.NoError(t, err)
	_, err = s.DB.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'failed' WHERE topic = $1`, viaPublish)
	require.NoError(t, err)
	n, err := moved.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, len(shapes), n)
	_, err = s.DB.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'pending' WHERE topic = $1`, viaPublish)
	require.NoError(t, err)
	n, err = published.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, len(shapes), n)
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)))

	require.Equal(t, len(shapes), movedInOneTransaction(t, s.DB, inDB))
	require.Zero(t, movedInOneTransaction(t, s.DB, viaPublish))

	// Without PublishBatch the publisher path sends aggregates from
	// concurrent Publish calls: its messages are matched by id.
	a, b := receive(t, ctx, tr, inDB, len(shapes)), map[string]*message.Message{}
	for _, m := range receive(t, ctx, tr, viaPublish, len(shapes)) {
		b[m.UUID] = m
	}
	for i := range shapes {
		require.Equal(t, fmt.Sprintf("%s-%d", inDB, i), a[i].UUID, "in-database order")
		b := b[fmt.Sprintf("%s-%d", viaPublish, i)]
		require.NotNil(t, b, "shape %d through the publisher", i)
		require.Equal(t, string(b.Payload), string(a[i].Payload), "shape %d payload", i)
		require.Equal(t, a[i].UUID, a[i].Metadata.Get(metadata.EventID))
		ma, mb := map[string]string(a[i].Metadata), map[string]string(b.Metadata)
		delete(ma, metadata.EventID)
		delete(mb, metadata.EventID)
		if ma[metadata.EventType] == inDB && mb[metadata.EventType] == viaPublish {
			delete(ma, metadata.EventType) // the default type: each topic's name
			delete(mb, metadata.EventType)
		}
		require.Equal(t, mb, ma, "shape %d metadata", i)
	}
	require.Equal(t, "overridden.v2", a[4].Metadata.Get(metadata.EventType))
	require.Equal(t, "custom-key", a[4].Metadata.Get(metadata.OrderingKey))
	require.Equal(t, "order/o-7", a[6].Metadata.Get(metadata.OrderingKey), "an empty ordering key does not unkey the aggregate")
	_, kept := a[6].Metadata["y"]
	require.True(t, kept, "empty user values are kept")
}

// TestInDatabasePublishHandsOddRowsToThePublisher: a hand-written row
// whose metadata is not an object of strings, or a row the topic's table
// refuses (an event id longer than watermill-sql's uuid column), makes the
// in-database publish of its batch give way to the publisher, which
// publishes the first (with the metadata its columns give, as it does on
// every transport) and backs the second off, while other topics' rows
// still go out.
func TestInDatabasePublishHandsOddRowsToThePublisher(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("metadata not a string map", func(t *testing.T) {
		s, tr := inDatabaseFixture(t)
		topic := "odd_" + watermill.NewShortUUID()
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", ID: "plain", Payload: []byte(`{}`)}))
		_, err := s.DB.ExecContext(ctx, `INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, metadata)
			VALUES ('hand-written', $1, 'b', '{}', '{"n": 1}')`, topic)
		require.NoError(t, err)
		rel, err := relay.New(postgres.From(s.DB), tr.Publisher(), relay.Config{})
		require.NoError(t, err)
		n, err := rel.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		got := receive(t, ctx, tr, topic, 2)
		require.ElementsMatch(t, []string{"plain", "hand-written"}, []string{got[0].UUID, got[1].UUID})
		for _, m := range got {
			require.Equal(t, m.UUID, m.Metadata.Get(metadata.EventID))
			require.NotEmpty(t, m.Metadata.Get(metadata.OrderingKey))
			require.Empty(t, m.Metadata.Get("n"))
		}
		require.Zero(t, movedInOneTransaction(t, s.DB, topic), "the batch went through the publisher")
	})

	t.Run("row the table refuses", func(t *testing.T) {
		s, tr := inDatabaseFixture(t)
		bad, good := "bad_"+watermill.NewShortUUID(), "good_"+watermill.NewShortUUID()
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB),
			outbox.Event{Topic: bad, AggregateID: "a", ID: fmt.Sprintf("%040d", 7), Payload: []byte(`{}`)},
			outbox.Event{Topic: good, AggregateID: "b", ID: "fine", Payload: []byte(`{}`)}))
		rel, err := relay.New(postgres.From(s.DB), tr.Publisher(), relay.Config{})
		require.NoError(t, err)
		n, err := rel.RunOnce(ctx)
		require.NoError(t, err, "a failed publish is the row's (backoff), not the relay's")
		require.Equal(t, 2, n)
		got := receive(t, ctx, tr, good, 1)
		require.Equal(t, "fine", got[0].UUID)
		var status, lastErr string
		var retries int
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT status, retry_count, coalesce(last_error, '') FROM millwright_outbox WHERE topic = $1`, bad).Scan(&status, &retries, &lastErr))
		require.Equal(t, "failed", status, "the refused row is failed at once: no retry can make the table take it (a permanent error)")
		require.Equal(t, 1, retries)
		require.Contains(t, lastErr, "too long")
	})
}

// TestInDatabasePublishOnAPoolOfOneConnection: the transport shares the
// outbox's pool and the pool has one connection. The relay's transaction
// holds it, so the new topic's table must be created before the
// transaction starts, not from inside it (that would wait forever).
func TestInDatabasePublishOnAPoolOfOneConnection(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, tr := inDatabaseFixture(t)
	s.DB.SetMaxOpenConns(1)
	topic := "one_conn_" + watermill.NewShortUUID()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", Payload: []byte(`{}`)}))
	rel, err := relay.New(postgres.From(s.DB), tr.Publisher(), relay.Config{})
	require.NoError(t, err)
	n, err := rel.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, movedInOneTransaction(t, s.DB, topic))
}

// TestInDatabasePublishIsExactlyOnceAndInOrderAcrossRelays: four relays
// (each may add a helper while its batches come back full) publish a
// backlog in the database while writers keep adding to it. Publish and
// mark commit together, so the consumer gets every event exactly once, and
// each aggregate's events in commit order.
func TestInDatabasePublishIsExactlyOnceAndInOrderAcrossRelays(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, tr := inDatabaseFixture(t)
	s.DB.SetMaxOpenConns(20)
	topic := "order_" + watermill.NewShortUUID()
	const aggs, perAgg = 40, 25
	write := func(from, to int) {
		for seq := from; seq < to; seq++ {
			evs := make([]outbox.Event, 0, aggs)
			for a := range aggs {
				evs = append(evs, outbox.Event{Topic: topic, AggregateType: "t", AggregateID: fmt.Sprint(a),
					Payload: []byte(fmt.Sprintf(`{"agg": %d, "seq": %d}`, a, seq))})
			}
			require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), evs...))
		}
	}
	write(0, perAgg/2)
	for range 4 {
		rel, err := relay.New(postgres.From(s.DB), tr.Publisher(), relay.Config{BatchSize: 20, PollInterval: 20 * time.Millisecond})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- rel.Run(ctx) }()
		t.Cleanup(func() {
			require.NoError(t, rel.Close())
			require.NoError(t, <-done)
		})
	}
	write(perAgg/2, perAgg)

	got := receive(t, ctx, tr, topic, aggs*perAgg)
	next := map[int]int{}
	for _, m := range got {
		var ev struct{ Agg, Seq int }
		require.NoError(t, json.Unmarshal(m.Payload, &ev))
		require.Equal(t, next[ev.Agg], ev.Seq, "aggregate %d: event %d arrived when %d was due (a duplicate or out of order)", ev.Agg, ev.Seq, next[ev.Agg])
		next[ev.Agg]++
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)))
	var extra int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) - $1 FROM "watermill_`+topic+`"`, aggs*perAgg).Scan(&extra))
	require.Zero(t, extra, "messages beyond the events written")
	require.Equal(t, aggs*perAgg, movedInOneTransaction(t, s.DB, topic))
}

// TestInDatabasePublishCarriesTheRelaySpan: with a tracer that records,
// each event published in the database gets the relay's span, a child of
// the writer's span when the event stored one, and the message carries
// that span's context, as on the publisher path, so the consumer's span
// becomes its child. Not parallel: the relay traces with the global
// provider, installed here and replaced by a no-op one (what the parallel
// tests see, like the default) before they run.
func TestInDatabasePublishCarriesTheRelaySpan(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(tracenoop.NewTracerProvider()) })

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, tr := inDatabaseFixture(t)
	topic := "traced_" + watermill.NewShortUUID()
	wctx, writer := tp.Tracer("test").Start(ctx, "write")
	require.NoError(t, outbox.AddOutsideTx(wctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", ID: "traced", Payload: []byte(`{}`)}))
	writer.End()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "b", ID: "untraced", Payload: []byte(`{}`)}))

	rel, err := relay.New(postgres.From(s.DB), tr.Publisher(), relay.Config{})
	require.NoError(t, err)
	n, err := rel.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, 2, movedInOneTransaction(t, s.DB, topic))

	relaySpans := map[string]sdktrace.ReadOnlySpan{}
	for _, sp := range spans.Ended() {
		if strings.HasPrefix(sp.Name(), tracing.SpanRelayPublish) {
			for _, a := range sp.Attributes() {
				if a.Key == "messaging.message.id" {
					relaySpans[a.Value.AsString()] = sp
				}
			}
		}
	}
	for _, m := range receive(t, ctx, tr, topic, 2) {
		sp, ok := relaySpans[m.UUID]
		require.True(t, ok, "no relay span for %s", m.UUID)
		require.Contains(t, m.Metadata.Get(metadata.TraceParent), sp.SpanContext().SpanID().String(), "%s carries its relay span's context", m.UUID)
		require.Equal(t, sp.SpanContext().TraceID().String(), m.Metadata.Get(metadata.TraceParent)[3:35])
		if m.UUID == "traced" {
			// Its parent is the span Add stored: Add's own write span,
			// the writer's child.
			require.Equal(t, writer.SpanContext().TraceID(), sp.SpanContext().TraceID(), "the relay span is in the writer's trace")
			var parent sdktrace.ReadOnlySpan
			for _, p := range spans.Ended() {
				if p.SpanContext().SpanID() == sp.Parent().SpanID() {
					parent = p
				}
			}
			require.NotNil(t, parent, "the relay span's parent was recorded")
			require.True(t, parent.SpanContext().SpanID() == writer.SpanContext().SpanID() || parent.Parent().SpanID() == writer.SpanContext().SpanID(),
				"the relay span descends from the writer's span (parent %q)", parent.Name())
		} else {
			require.NotEqual(t, writer.SpanContext().TraceID(), sp.SpanContext().TraceID(), "an event written outside any span starts its own trace")
		}
	}
}
