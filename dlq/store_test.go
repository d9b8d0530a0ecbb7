package dlq_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// recordingPublisher keeps what is published; it fails while fail is set.
type recordingPublisher struct {
	mu   sync.Mutex
	sent []sent
	fail error
}

type sent struct {
	topic string
	msg   *message.Message
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil {
		return p.fail
	}
	for _, m := range msgs {
		p.sent = append(p.sent, sent{topic, m})
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) published() []sent {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]sent(nil), p.sent...)
}

// deadLetter builds a message as the middleware publishes it.
func deadLetter(topic, errText string, last time.Time) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"n":1}`))
	md := msg.Metadata
	md.Set(metadata.EventID, "evt-"+msg.UUID)
	md.Set(metadata.TraceParent, traceParent)
	md.Set(metadata.DeadLetterOriginalTopic, topic)
	md.Set(metadata.DeadLetterTopic, dlq.DefaultTopic(topic))
	md.Set(metadata.DeadLetterConsumerGroup, "billing")
	md.Set(metadata.DeadLetterHandler, "h")
	md.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
	md.Set(metadata.DeadLetterError, errText)
	md.Set(metadata.DeadLetterErrorType, "*errors.errorString")
	md.Set(metadata.DeadLetterAttempts, "5")
	md.Set(metadata.DeadLetterFirstFailure, last.Add(-time.Second).Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterLastFailure, last.Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterOriginalMessageID, msg.UUID)
	return msg
}

func newStore(t *testing.T) (*dlq.Store, *pgtest.Schema) { return newStoreOn(t, pgtest.DriverPQ) }

// newStoreOn is newStore on driver: a *sql.DB for pgtest.DriverPQ, a
// *pgxpool.Pool for pgtest.DriverPgx.
func newStoreOn(t *testing.T, driver string) (*dlq.Store, *pgtest.Schema) {
	t.Helper()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(4)
	var store *dlq.Store
	db := postgres.SQL(s.DB)
	if driver == pgtest.DriverPgx {
		p := s.Pgx(t)
		store, db = dlq.NewStore(postgres.Pgx(p)), postgres.Pgx(p)
	} else {
		store = dlq.NewStore(db)
	}
	stores.Store(store, storeOf{db: db, schema: s})
	return store, s
}

// stores maps a test's Store to its database and schema.
var stores sync.Map

type storeOf struct {
	db     postgres.DB
	schema *pgtest.Schema
}

func handlesOf(t *testing.T, store *dlq.Store) storeOf {
	t.Helper()
	v, ok := stores.Load(store)
	require.True(t, ok, "the store was not made by newStoreOn")
	return v.(storeOf)
}

// replay runs dlq.Replay on store's database, as operator "tester".
func replay(t *testing.T, ctx context.Context, store *dlq.Store, opts dlq.ReplayOptions) (dlq.ReplayReport, error) {
	t.Helper()
	if opts.By.User == "" {
		opts.By = audit.Operator{User: "tester"}
	}
	return dlq.Replay(ctx, handlesOf(t, store).db, opts)
}

// relayQueued publishes the events queued in store's outbox with pub and
// removes them, in id order: what a relay does, without its lanes.
func relayQueued(t *testing.T, store *dlq.Store, pub message.Publisher) {
	t.Helper()
	for _, e := range queued(t, store) {
		require.NoError(t, pub.Publish(e.topic, e.msg))
	}
	_, err := handlesOf(t, store).schema.DB.Exec(`DELETE FROM millwright_outbox`)
	require.NoError(t, err)
}

// queued returns the events queued in store's outbox, in id order, as the
// relay publishes them (its UUID is the event id).
func queued(t *testing.T, store *dlq.Store) []sent {
	t.Helper()
	rows, err := handlesOf(t, store).schema.DB.Query(`SELECT topic, event_id, COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), metadata::text FROM millwright_outbox ORDER BY id`)
	require.NoError(t, err)
	defer rows.Close()
	var out []sent
	for rows.Next() {
		var topic, id, md string
		var payload []byte
		require.NoError(t, rows.Scan(&topic, &id, &payload, &md))
		m := message.NewMessage(id, payload)
		require.NoError(t, json.Unmarshal([]byte(md), &m.Metadata))
		m.Metadata.Set(metadata.EventID, id) // the relay sets it from the event_id column
		out = append(out, sent{topic, m})
	}
	require.NoError(t, rows.Err())
	return out
}

func insert(t *testing.T, store *dlq.Store, msgs ...*message.Message) []int64 {
	t.Helper()
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		id, err := store.Insert(context.Background(), m)
		require.NoError(t, err)
		require.NotZero(t, id)
		ids[i] = id
	}
	return ids
}

// eventually polls cond until it holds or 10 s pass: for state that
// another connection or goroutine changes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, 10*time.Second, cond, "%s", what)
}

// TestRecorderStoresDeadLetters runs the whole path: a failing handler, the
// middleware, the dead-letter topic and the recorder handler.
func TestRecorderStoresDeadLetters(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, _ := newStoreOn(t, driver)
		ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
		t.Cleanup(func() { _ = ps.Close() })
		mw, err := dlq.NewMiddleware(ps, dlq.Config{Retry: fastRetry, ConsumerGroup: "billing", MaxValueBytes: -1})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddConsumerHandler("charge", "orders", ps, func(*message.Message) error {
			explode()
			return nil
		}).AddMiddleware(mw.Middleware)
		router.AddConsumerHandler("dlq-recorder", "orders.dlq", ps, store.Record)
		done := make(chan struct{})
		go func() { defer close(done); _ = router.Run(ctx) }()
		t.Cleanup(func() { _ = router.Close(); <-done })
		<-router.Running()

		orig := message.NewMessage(watermill.NewUUID(), []byte(`{"order":7}`))
		orig.Metadata.Set(metadata.TraceParent, traceParent)
		require.NoError(t, ps.Publish("orders", orig))

		var rows []dlq.DeadLetter
		eventually(t, "the dead letter row", func() bool {
			rows, err = store.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			return len(rows) == 1
		})
		d := rows[0]
		require.Equal(t, orig.UUID, d.MessageUUID)
		require.Equal(t, "orders", d.OriginalTopic)
		require.Equal(t, "orders.dlq", d.DeadLetterTopic)
		require.Equal(t, "billing", d.ConsumerGroup)
		require.Equal(t, "charge", d.Handler)
		require.Equal(t, dlq.ReasonPanic, d.Reason)
		require.Equal(t, "panic: nil map in pricing", d.Error)
		require.Equal(t, "*retry.PanicError", d.ErrorType)
		require.Contains(t, d.Stack, "dlq_test.explode")
		require.Equal(t, 3, d.Attempts)
		require.True(t, d.LastFailure.After(d.FirstFailure))
		require.Equal(t, `{"order":7}`, string(d.Payload))
		require.Equal(t, map[string]string{metadata.TraceParent: traceParent}, d.Metadata, "original metadata without dlq_ keys")
		require.Nil(t, d.ReplayedAt)

		got, err := store.Get(ctx, d.ID)
		require.NoError(t, err)
		require.Equal(t, d.MessageUUID, got.MessageUUID)
		_, err = store.Get(ctx, d.ID+1000)
		require.ErrorIs(t, err, dlq.ErrNotFound)
	})
}

func TestRecordIsIdempotent(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		store, _ := newStoreOn(t, driver)
		msg := deadLetter("orders", "boom", time.Now())
		insert(t, store, msg)
		id, err := store.Insert(context.Background(), msg)
		require.NoError(t, err)
		require.Zero(t, id, "a redelivered dead letter is not stored twice")
		require.NoError(t, store.Record(msg))
		n, err := store.Count(context.Background(), dlq.Filter{})
		require.NoError(t, err)
		require.Equal(t, 1, n)
	})
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, _ := newStoreOn(t, driver)
		t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		ids := insert(t, store,
			deadLetter("orders", "payment declined", t0),
			deadLetter("orders", "Timeout talking to stock", t0.Add(time.Hour)),
			deadLetter("invoices", "timeout talking to mailer", t0.Add(2*time.Hour)),
		)
		list := func(f dlq.Filter) []int64 {
			rows, err := store.List(ctx, f)
			require.NoError(t, err)
			out := []int64{}
			for _, r := range rows {
				out = append(out, r.ID)
			}
			return out
		}
		require.Equal(t, ids, list(dlq.Filter{}))
		require.Equal(t, ids[:2], list(dlq.Filter{Topic: "orders"}))
		require.Equal(t, ids[1:], list(dlq.Filter{ErrorContains: "TIMEOUT"}))
		require.Equal(t, ids[1:2], list(dlq.Filter{Since: t0.Add(time.Minute), Until: t0.Add(2 * time.Hour)}))
		require.Equal(t, ids[:1], list(dlq.Filter{Limit: 1}))
		require.Equal(t, ids[2:], list(dlq.Filter{IDs: []int64{ids[2]}}))
		require.Empty(t, list(dlq.Filter{Topic: "orders", ErrorContains: "mailer"}))

		depth, err := store.Depth(ctx)
		require.NoError(t, err)
		require.Equal(t, map[string]int64{"orders": 2, "invoices": 1}, depth)
	})
}

func TestReplayDryRunPublishesNothing(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, _ := newStoreOn(t, driver)
		ids := insert(t, store, deadLetter("orders", "a", time.Now()), deadLetter("invoices", "b", time.Now()))
		rep, err := replay(t, ctx, store, dlq.ReplayOptions{DryRun: true})
		require.NoError(t, err)
		require.True(t, rep.DryRun)
		require.Len(t, rep.Items, 2)
		require.Equal(t, ids[0], rep.Items[0].ID)
		require.Equal(t, "orders", rep.Items[0].To)
		require.Equal(t, "invoices", rep.Items[1].To)
		require.Empty(t, queued(t, store))
		rows, err := store.List(ctx, dlq.Filter{Pending: true})
		require.NoError(t, err)
		require.Len(t, rows, 2, "a dry run marks nothing")

		rep, err = replay(t, ctx, store, dlq.ReplayOptions{DryRun: true, Target: "orders.retry"})
		require.NoError(t, err)
		require.Equal(t, "orders.retry", rep.Items[1].To)
	})
}

func TestReplayPublishesMarksAndSkipsReplayed(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, _ := newStoreOn(t, driver)
		orig := deadLetter("orders", "boom", time.Now())
		ids := insert(t, store, orig)

		rep, err := replay(t, ctx, store, dlq.ReplayOptions{})
		require.NoError(t, err)
		require.Len(t, rep.Items, 1)
		sentMsgs := queued(t, store)
		require.Len(t, sentMsgs, 1)
		require.Equal(t, "orders", sentMsgs[0].topic)
		m := sentMsgs[0].msg
		require.Equal(t, "evt-"+orig.UUID, m.UUID, "the relay publishes a replay with its event id as UUID")
		require.Equal(t, orig.Payload, m.Payload)
		delete(m.Metadata, metadata.EventSource) // the outbox's default source
		require.Equal(t, "application/json", m.Metadata.Get(metadata.EventDataContentType), "the outbox says a JSON payload is JSON")
		delete(m.Metadata, metadata.EventDataContentType)
		require.Equal(t, message.Metadata{
			metadata.EventID:             "evt-" + orig.UUID,
			metadata.TraceParent:         traceParent,
			metadata.DeadLetterReplayOf:  strconv.FormatInt(ids[0], 10),
			metadata.DeadLetterReplayFor: dlq.ReplayTarget("billing", "h"), // the consumer recorded on it
		}, m.Metadata)
		d, err := store.Get(ctx, ids[0])
		require.NoError(t, err)
		require.NotNil(t, d.ReplayedAt)
		require.Equal(t, 1, d.ReplayCount)

		rep, err = replay(t, ctx, store, dlq.ReplayOptions{})
		require.NoError(t, err)
		require.Empty(t, rep.Items, "a second replay publishes nothing")
		require.Equal(t, 1, rep.SkippedReplayed)
		require.Len(t, queued(t, store), 1)

		rep, err = replay(t, ctx, store, dlq.ReplayOptions{Force: true, Target: "orders.v2"})
		require.NoError(t, err)
		require.Len(t, rep.Items, 1)
		require.Equal(t, "orders.v2", queued(t, store)[1].topic)
		d, err = store.Get(ctx, ids[0])
		require.NoError(t, err)
		require.Equal(t, 2, d.ReplayCount)
	})
}

// A replay where the outbox tables are missing fails naming the fix, and
// changes nothing: the row stays dead, no audit row is written.
func TestReplayWithoutTheOutboxChangesNothing(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		s := pgtest.New(t, dlq.Migrations(), audit.Migrations())
		store := dlq.NewStore(postgres.From(s.DB))
		ids := insert(t, store, deadLetter("orders", "boom", time.Now()))
		_, err := dlq.Replay(ctx, s.Handles(t, driver), dlq.ReplayOptions{By: audit.Operator{User: "tester"}})
		require.ErrorContains(t, err, "millwright migrate")
		d, err := store.Get(ctx, ids[0])
		require.NoError(t, err)
		require.Equal(t, dlq.StateDead, d.State)
		require.Nil(t, d.ReplayedAt)
		require.Zero(t, d.ReplayCount)
		require.Equal(t, []int{0}, pgtest.Column[int](t, s.DB, `SELECT count(*)::int FROM millwright_audit`))
	})
}

func TestReplayRateLimit(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t)
	for range 5 {
		insert(t, store, deadLetter("orders", "boom", time.Now()))
	}
	start := time.Now()
	rep, err := replay(t, context.Background(), store, dlq.ReplayOptions{Rate: 100})
	require.NoError(t, err)
	require.Len(t, rep.Items, 5)
	// 5 messages at 100/s: the 5th may not go before 40 ms.
	require.GreaterOrEqual(t, time.Since(start), 40*time.Millisecond)

	_, err = replay(t, context.Background(), store, dlq.ReplayOptions{Rate: -1})
	require.ErrorContains(t, err, "rate")
}

func TestDepthCollector(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		store, _ := newStoreOn(t, driver)
		insert(t, store, deadLetter("orders", "a", time.Now()), deadLetter("orders", "b", time.Now()))
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(dlq.NewDepthCollector(store))
		mfs, err := reg.Gather()
		require.NoError(t, err)
		require.Len(t, mfs, 1)
		require.Equal(t, dlq.MetricDepth, mfs[0].GetName())
		require.Equal(t, 2.0, mfs[0].GetMetric()[0].GetGauge().GetValue())
	})
}

// TestReplayAfterFixProcessesOnce: a message fails until a bug is fixed,
// is parked and recorded, then replayed; with the idempotency middleware in
// the chain, replaying it again by force does not process it twice.
func TestReplayAfterFixProcessesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store, _ := newStore(t)
	// Publish returns once the subscriber acked: the assertions below know
	// the message was handled when Replay returns.
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })

	mw, err := dlq.NewMiddleware(ps, dlq.Config{Retry: fastRetry})
	require.NoError(t, err)
	dedup, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "billing", Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	var fixed atomic.Bool
	processed := make(chan string, 10)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	h := router.AddConsumerHandler("charge", "orders", ps, func(msg *message.Message) error {
		if !fixed.Load() {
			return errors.New("bug: cannot charge")
		}
		processed <- msg.Metadata.Get(metadata.EventID)
		return nil
	})
	h.AddMiddleware(mw.Middleware, dedup.Middleware)
	router.AddConsumerHandler("dlq-recorder", "orders.dlq", ps, store.Record)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	t.Cleanup(func() { _ = router.Close(); <-done })
	<-router.Running()

	msg := message.NewMessage(watermill.NewUUID(), []byte("charge 10"))
	msg.Metadata.Set(metadata.EventID, "evt-1")
	require.NoError(t, ps.Publish("orders", msg))
	eventually(t, "the dead letter row", func() bool {
		n, err := store.Count(ctx, dlq.Filter{})
		require.NoError(t, err)
		return n == 1
	})

	fixed.Store(true)
	rep, err := replay(t, ctx, store, dlq.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Items, 1)
	relayQueued(t, store, ps)
	select {
	case id := <-processed:
		require.Equal(t, "evt-1", id)
	case <-time.After(10 * time.Second):
		t.Fatal("replayed message not processed")
	}

	// Forced replay again: delivered (the publisher blocks until the
	// handler acked it), but the idempotency middleware skips it.
	rep, err = replay(t, ctx, store, dlq.ReplayOptions{Force: true})
	require.NoError(t, err)
	require.Len(t, rep.Items, 1)
	relayQueued(t, store, ps)
	require.Empty(t, processed, "the replayed event was processed twice")
}

// A Store on a nil pool fails every call with an error that says so,
// instead of panicking.
func TestStoreOnNilPoolFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := dlq.Replay(ctx, postgres.DB{}, dlq.ReplayOptions{DryRun: true})
	require.ErrorIs(t, err, postgres.ErrNoDB)
	for _, store := range []*dlq.Store{dlq.NewStore(postgres.From((*sql.DB)(nil))), dlq.NewStore(postgres.From((*pgxpool.Pool)(nil)))} {
		_, err := store.List(ctx, dlq.Filter{})
		require.ErrorContains(t, err, "db is nil")
		_, err = store.Insert(ctx, deadLetter("orders", "boom", time.Now()))
		require.ErrorContains(t, err, "db is nil")
		_, err = store.Depth(ctx)
		require.ErrorContains(t, err, "db is nil")
	}
}
