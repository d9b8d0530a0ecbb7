package relay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

type bundle struct {
	db     *sql.DB
	schema *pgtest.Schema
	pubsub *gochannel.GoChannel
}

func setup(t *testing.T) bundle {
	t.Helper()
	s := pgtest.New(t, layoutMigrations(t)...) // partition_test.go: the plain or the partitioned layout
	// The pool millwright opens and postgres.Open gives users (its BEGIN
	// carries first statements). s.DB (lib/pq's own pool) stays for the
	// tests that look from outside.
	db, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(8)
	// Blocking until acked keeps gochannel in publish order; it otherwise
	// delivers each message from its own goroutine.
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100000, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	return bundle{db: db, schema: s, pubsub: ps}
}

// collector records every message of a topic.
type collector struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (b bundle) collect(t *testing.T, topic string) *collector {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := b.pubsub.Subscribe(ctx, topic)
	require.NoError(t, err)
	c := &collector{}
	go func() {
		for m := range ch {
			c.mu.Lock()
			c.msgs = append(c.msgs, m)
			c.mu.Unlock()
			m.Ack()
		}
	}()
	return c
}

func (c *collector) all() []*message.Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*message.Message(nil), c.msgs...)
}

// eventually polls cond until it holds or d passes.
var eventually = poll.Until

func startRelay(t *testing.T, db *sql.DB, pub message.Publisher, cfg Config) *Relay {
	t.Helper()
	r, err := New(postgres.From(db), pub, cfg)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-errc)
	})
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("relay not running after 10s")
	}
	return r
}

func count(t *testing.T, db *sql.DB, where string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+where).Scan(&n))
	return n
}

func TestAdd_RollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "orders", AggregateID: "o1", Payload: []byte(`{"a":1}`)}))
	pub, err := outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("raw"))))
	require.Equal(t, 2, countTx(t, tx))
	require.NoError(t, tx.Rollback())
	require.Equal(t, 0, count(t, b.db, "true"))
}

func countTx(t *testing.T, tx *sql.Tx) int {
	var n int
	require.NoError(t, tx.QueryRow(`SELECT count(*) FROM millwright_outbox`).Scan(&n))
	return n
}

func TestAdd_Validation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	err := outbox.AddOutsideTx(context.Background(), postgres.From(b.db), outbox.Event{AggregateID: "x"})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorContains(t, err, "Topic is empty")
	require.ErrorIs(t, outbox.Add(context.Background(), postgres.Tx{}, outbox.Event{Topic: "t"}), postgres.ErrNoDB)
}

func TestRelay_CommittedEventsArePublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "orders")
	ctx := context.Background()

	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "o1", EventType: "order.created.v1",
		Payload: []byte(`{"total": 10}`), ID: "ev-1", Metadata: map[string]string{metadata.TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}))
	pub, err := outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{Source: "svc"})
	require.NoError(t, err)
	wm := message.NewMessage("ev-2", []byte{0xff, 0x00, 0x01}) // not JSON: stored as bytes
	wm.Metadata.Set(metadata.AggregateID, "o1")
	wm.Metadata.Set(metadata.AggregateType, "order")
	wm.Metadata.Set("custom", "yes")
	require.NoError(t, pub.Publish("orders", wm))
	require.NoError(t, tx.Commit())

	startRelay(t, b.db, b.pubsub, Config{ListenURL: b.schema.URL})
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 2 }, "want 2 messages")
	msgs := got.all()
	require.Equal(t, "ev-1", msgs[0].UUID)
	require.JSONEq(t, `{"total": 10}`, string(msgs[0].Payload))
	require.Equal(t, "ev-1", msgs[0].Metadata.Get(metadata.EventID))
	require.Equal(t, "order/o1", msgs[0].Metadata.Get(metadata.OrderingKey))
	require.Equal(t, "order.created.v1", msgs[0].Metadata.Get(metadata.EventType))
	require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", msgs[0].Metadata.Get(metadata.TraceParent))
	require.Equal(t, "ev-2", msgs[1].UUID)
	require.Equal(t, []byte{0xff, 0x00, 0x01}, []byte(msgs[1].Payload))
	require.Equal(t, "yes", msgs[1].Metadata.Get("custom"))
	require.Equal(t, "svc", msgs[1].Metadata.Get(metadata.EventSource))
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'published'") == 2 }, "rows marked published")
}

func TestRelay_ListenWakesWithoutPolling(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	// A poll interval far beyond the deadline: only NOTIFY can deliver.
	// Lease 3m: an idle relay also wakes after a third of its lease (10 s
	// by default, 5 s after these waits' old 5 s ceilings); with 60 s the 30 s
	// ceilings below still tell a wake-up from that timer on a loaded machine.
	startRelay(t, b.db, b.pubsub, Config{ListenURL: b.schema.URL, PollInterval: time.Hour, Lease: 3 * time.Minute})
	// LISTEN is active once Running is closed (startRelay waits for it):
	// the first claim ran before anything was written; now write.
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "NOTIFY should wake the relay")
}

// hookPublisher wraps a publisher with fault injection.
type hookPublisher struct {
	message.Publisher
	fail func(topic string, m *message.Message) error
}

func (p *hookPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if p.fail != nil {
			if err := p.fail(topic, m); err != nil {
				return err
			}
		}
		if err := p.Publisher.Publish(topic, m); err != nil {
			return err
		}
	}
	return nil
}

func TestRelay_KilledBetweenPublishAndMarkRepublishes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: strconv.Itoa(i % 4), Payload: []byte(strconv.Itoa(i))}))
	}

	r1, err := New(postgres.From(b.db), b.pubsub, Config{Lease: 200 * time.Millisecond, PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	runCtx, kill := context.WithCancel(ctx)
	var killed atomic.Bool
	r1.afterPublish = func(context.Context, []int64) {
		killed.Store(true)
		kill() // dies after the broker accepted the batch, before marking it
	}
	require.NoError(t, r1.Run(runCtx))
	require.True(t, killed.Load())
	require.Equal(t, 0, count(t, b.db, "status = 'published'"), "nothing may be marked after the kill")
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 20 }, "the killed relay published its batch")

	startRelay(t, b.db, b.pubsub, Config{PollInterval: 20 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "second relay drains")
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 40 }, "the killed batch is republished once (at-least-once)")
	seen := map[string]int{}
	for _, m := range got.all() {
		seen[m.UUID]++
	}
	require.Len(t, seen, 20, "every event published")
	for id, n := range seen {
		require.Equal(t, 2, n, "event %s: once by the killed relay, once by the next", id)
	}
}

// writeSequences appends events with per-aggregate sequence numbers from
// several goroutines, one or two events per transaction. Each writer owns
// its aggregates, as an application serialises writers of one aggregate by
// locking its row.
func writeSequences(t *testing.T, db *sql.DB, topic string, aggregates, perAggregate, writers int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			next := map[int]int{}
			for done := false; !done; {
				done = true
				for a := w; a < aggregates; a += writers {
					seq := next[a] + 1
					if seq > perAggregate {
						continue
					}
					done = false
					n := 1
					if seq%3 == 0 && seq < perAggregate {
						n = 2
					}
					var evs []outbox.Event
					for k := 0; k < n; k++ {
						evs = append(evs, outbox.Event{Topic: topic, AggregateType: "acct", AggregateID: fmt.Sprint("a", a),
							Payload: []byte(strconv.Itoa(seq + k))})
					}
					tx, err := db.Begin()
					if err != nil {
						errs <- err
						return
					}
					if err := outbox.Add(context.Background(), postgres.SQLTx(tx), evs...); err != nil {
						_ = tx.Rollback()
						errs <- err
						return
					}
					if err := tx.Commit(); err != nil {
						errs <- err
						return
					}
					next[a] = seq + n - 1
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// firstDeliveries calls f with the aggregate and the integer payload of
// each message in msgs, in order, duplicates (by UUID) dropped, and
// returns the number of distinct messages.
func firstDeliveries(t *testing.T, msgs []*message.Message, f func(agg string, seq int)) int {
	t.Helper()
	seen := map[string]bool{}
	for _, m := range msgs {
		if seen[m.UUID] {
			continue
		}
		seen[m.UUID] = true
		seq, err := strconv.Atoi(string(m.Payload))
		require.NoError(t, err)
		f(m.Metadata.Get(metadata.AggregateID), seq)
	}
	return len(seen)
}

// checkOrder asserts that, dropping duplicates, each aggregate's events
// arrived as 1, 2, 3, ... n.
func checkOrder(t *testing.T, msgs []*message.Message, aggregates, perAggregate int) {
	t.Helper()
	next := map[string]int{}
	firstDeliveries(t, msgs, func(agg string, seq int) {
		require.Equal(t, next[agg]+1, seq, "aggregate %s out of order", agg)
		next[agg] = seq
	})
	require.Len(t, next, aggregates)
	for agg, n := range next {
		require.Equal(t, perAggregate, n, "aggregate %s incomplete", agg)
	}
}

func TestRelay_PerAggregateOrderWithConcurrentRelays(t *testing.T) {
	t.Parallel()
	for _, relays := range []int{2, 4} {
		t.Run(fmt.Sprint(relays, "relays"), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			got := b.collect(t, "t")
			// Publishes fail now and then: failures must hold back only
			// their aggregate and never reorder it. Each message fails at
			// most once: a plain "every 17th message" would fail every
			// Publish call of 17 messages or more, forever.
			var calls, hiccups atomic.Int64
			var failed sync.Map
			pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
				if calls.Add(1)%17 == 0 {
					if _, again := failed.LoadOrStore(m.UUID, true); !again {
						hiccups.Add(1)
						return errors.New("broker hiccup")
					}
				}
				return nil
			}}
			cfg := Config{BatchSize: 50, PollInterval: 5 * time.Millisecond, ListenURL: b.schema.URL,
				Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxAttempts: -1}}
			pubs := make([]*countingPublisher, relays)
			for i := range pubs {
				pubs[i] = &countingPublisher{Publisher: pub}
				startRelay(t, b.db, pubs[i], cfg)
			}
			const aggregates, perAggregate = 12, 40
			writeSequences(t, b.db, "t", aggregates, perAggregate, 4)
			eventually(t, 20*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
			checkOrder(t, got.all(), aggregates, perAggregate)
			require.Equal(t, 0, count(t, b.db, "status = 'failed'"))
			require.Positive(t, hiccups.Load(), "no publish failed: the test did not exercise failures")
			for i, p := range pubs {
				require.Positive(t, p.published.Load(), "relay %d published nothing: the relays did not run concurrently", i)
			}
		})
	}
}

// countingPublisher counts the messages its Publisher accepted: which
// relay published how much.
type countingPublisher struct {
	message.Publisher
	published atomic.Int64
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.published.Add(int64(len(msgs)))
	return nil
}

// fakeBatch is a BatchPublisher over gochannel that can fail some
// messages. As the BatchPublisher contract requires, a failed message
// stops its ordering key: the later ones of the key are not sent.
type fakeBatch struct {
	message.Publisher
	calls  atomic.Int64
	failAt func(call int64, i int) bool
}

func (p *fakeBatch) PublishBatch(topic string, msgs ...*message.Message) error {
	call := p.calls.Add(1)
	be := &batch.Error{Failed: map[int]error{}}
	stopped := map[string]bool{}
	for i, m := range msgs {
		key := m.Metadata.Get(metadata.OrderingKey)
		if stopped[key] {
			be.Failed[i] = errors.New("not sent: an earlier message of its key failed")
			continue
		}
		if p.failAt != nil && p.failAt(call, i) {
			be.Failed[i] = errors.New("partition leader moved")
			stopped[key] = true
			continue
		}
		if err := p.Publisher.Publish(topic, m); err != nil {
			be.Failed[i] = err
		}
	}
	if len(be.Failed) > 0 {
		return be
	}
	return nil
}

func TestRelay_BatchPublisherKeepsOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	// Fail the first message of every third call: the relay must publish
	// it and the later messages of its aggregate again, in order.
	var failures atomic.Int64
	pub := &fakeBatch{Publisher: b.pubsub, failAt: func(call int64, i int) bool {
		if call%3 == 0 && i == 0 {
			failures.Add(1)
			return true
		}
		return false
	}}
	const aggregates, perAggregate = 6, 50
	writeSequences(t, b.db, "t", aggregates, perAggregate, 3)
	cfg := Config{BatchSize: 64, PollInterval: 5 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxAttempts: -1}}
	startRelay(t, b.db, pub, cfg)
	startRelay(t, b.db, pub, cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
	// What a consumer that drops duplicates applies: the first copy of
	// each event, in order.
	checkOrder(t, got.all(), aggregates, perAggregate)
	require.Greater(t, pub.calls.Load(), int64(1))
	require.Positive(t, failures.Load(), "no publish failed: the test did not exercise failures")
}

func TestRelay_PoisonRowFailsWhileOthersFlow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	dlq := b.collect(t, "t.dead")
	ctx := context.Background()
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, m *message.Message) error {
		if string(m.Payload) == `"poison"` && topic == "t" {
			return errors.New("message too large")
		}
		return nil
	}}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db),
		outbox.Event{Topic: "t", AggregateID: "bad", Payload: []byte(`"poison"`)},
		outbox.Event{Topic: "t", AggregateID: "bad", Payload: []byte(`"after"`)}))
	for i := 0; i < 30; i++ {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: fmt.Sprint("good", i%3), Payload: []byte(`"ok"`)}))
	}
	reg := newTestRegistry()
	startRelay(t, b.db, pub, Config{PollInterval: 5 * time.Millisecond, DeadLetterTopic: "t.dead", Registerer: reg, MetricsInterval: 10 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 2 * time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxAttempts: 3}})
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'failed'") == 1 }, "poison row fails")
	var retries int
	var lastErr string
	require.NoError(t, b.db.QueryRow(`SELECT retry_count, last_error FROM millwright_outbox WHERE status = 'failed'`).Scan(&retries, &lastErr))
	require.Equal(t, 3, retries)
	require.Contains(t, lastErr, "message too large")
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "the rest drains")
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 31 && len(dlq.all()) == 1 }, "31 published, 1 dead-lettered")
	msgs := got.all()
	require.Equal(t, `"after"`, string(msgs[len(msgs)-1].Payload), "the poison row's successor waits for it")
	require.Equal(t, "message too large", dlq.all()[0].Metadata.Get(MetadataDeadLetterError))
	eventually(t, 30*time.Second, func() bool { return reg.value(t, MetricFailedCount) == 1 }, "failed gauge")
	require.Equal(t, 1.0, reg.value(t, MetricFailed))
	// The counter follows the mark's commit, which the look at the table
	// above may see first.
	eventually(t, 30*time.Second, func() bool { return reg.value(t, MetricPublished) == 31 }, "published counter")
	require.Equal(t, 3.0, reg.value(t, MetricPublishErrors))
}

func TestRelayConfig_Validate(t *testing.T) {
	t.Parallel()
	_, err := New(postgres.From(&sql.DB{}), gochannel.NewGoChannel(gochannel.Config{}, nil), Config{BatchSize: 20000})
	require.ErrorContains(t, err, "BatchSize 20000: want 1..10000")
	_, err = New(postgres.From((*sql.DB)(nil)), nil, Config{})
	require.Error(t, err)
}

// tableOID is the oid of the test schema's outbox table, the second half of
// the wake-up lock's key.
func tableOID(t *testing.T, db *sql.DB) int64 {
	t.Helper()
	var oid int64
	require.NoError(t, db.QueryRow(`SELECT 'millwright_outbox'::regclass::oid::int8`).Scan(&oid))
	return oid
}

// A writer in its transaction when the relay goes idle holds the wake-up
// lock shared: it will not notify, and the relay cannot take the lock. The
// relay must still publish its event once it commits, without waiting out
// the poll interval.
func TestRelay_NoLostWakeupForWriterInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	ctx := context.Background()
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "t", AggregateID: "a"}))

	// Lease 3m: an idle relay also wakes after a third of its lease (10 s
	// by default, 5 s after these waits' old 5 s ceilings); with 60 s the 30 s
	// ceilings below still tell a wake-up from that timer on a loaded machine.
	startRelay(t, b.db, b.pubsub, Config{ListenURL: b.schema.URL, PollInterval: time.Hour, Lease: 3 * time.Minute})
	// The relay has gone idle and tried the lock: its waiting connection
	// ran the try (and failed, since the writer holds it shared).
	eventually(t, 30*time.Second, func() bool { return triedWakeupLock(t, b) > 0 }, "idle relay tries the wake-up lock")
	require.NoError(t, tx.Commit())
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "event published without a notification or poll")
}

// Writers notify only while a relay holds the wake-up lock (is idle), and a
// rolled-back writer notifies nobody. Notifications reach a listener in
// commit order, so a marker sent after a write shows whether the write
// notified.
func TestTrigger_NotifiesOnlyWhileARelayWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	marker, next := listenNotifications(t, b)

	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	marker("m1")
	require.Equal(t, "m1", next(), "no relay waits: the writer did not notify")

	// An idle relay: a session holding the lock exclusively.
	waiter, err := b.db.Conn(ctx)
	require.NoError(t, err)
	defer waiter.Close()
	key := fmt.Sprintf("%d, %d", wakeLockClass, int32(tableOID(t, b.db)))
	var held bool
	require.NoError(t, waiter.QueryRowContext(ctx, `SELECT pg_try_advisory_lock(`+key+`)`).Scan(&held))
	require.True(t, held)
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "t", AggregateID: "a"}))
	require.NoError(t, tx.Rollback())
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	marker("m2")
	require.Equal(t, "", next(), "the committed writer notified the waiting relay")
	require.Equal(t, "m2", next(), "the rolled-back writer did not")

	_, err = waiter.ExecContext(ctx, `SELECT pg_advisory_unlock(`+key+`)`)
	require.NoError(t, err)
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	marker("m3")
	require.Equal(t, "m3", next(), "the relay woke: writers stop notifying")
}

// ListenURL must reach the relay's outbox table; one in another schema
// would take a wake-up lock no writer of this table tries, so listen
// refuses it (Run then logs the error and polls).
func TestRelay_ListenURLOfAnotherSchemaIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other := pgtest.New(t, outbox.Migrations())
	r, err := New(postgres.From(b.db), b.pubsub, Config{ListenURL: other.URL})
	require.NoError(t, err)
	_, err = r.listen(context.Background(), make(chan struct{}, 1))
	require.ErrorContains(t, err, "relay.Config.ListenURL reaches millwright_outbox in")
	require.ErrorContains(t, err, "point both at the same database and search_path")
}

// A failing aggregate with a backlog larger than the claim window must not
// hide the aggregates behind it: its followers are parked with it.
func TestRelay_FailingAggregateBacklogDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	ctx := context.Background()
	var evs []outbox.Event
	for i := 0; i < 60; i++ { // 12 x the window of BatchSize 5
		evs = append(evs, outbox.Event{Topic: "t", AggregateID: "bad", Payload: []byte(strconv.Itoa(i))})
	}
	for i := 0; i < 20; i++ {
		evs = append(evs, outbox.Event{Topic: "t", AggregateID: fmt.Sprint("good", i), Payload: []byte(`"ok"`)})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
		if m.Metadata.Get(metadata.AggregateID) == "bad" {
			return errors.New("bad aggregate")
		}
		return nil
	}}
	startRelay(t, b.db, pub, Config{BatchSize: 5, PollInterval: 5 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 50 * time.Millisecond, MaxAttempts: -1}})
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 20 }, "the other aggregates flow")
	require.Equal(t, 60, count(t, b.db, "status = 'pending' AND aggregate_id = 'bad'"))
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "aggregate_id = 'bad' AND retry_count >= 2") == 1 }, "the bad head keeps retrying")
}

func TestAdd_RefusesOversizedEventAtWriteTime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	big := make([]byte, outbox.DefaultMaxEventBytes+1)
	for i := range big {
		big[i] = 'x'
	}
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // test
	err = outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: big})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorContains(t, err, "over the limit of 1048576")
	require.ErrorContains(t, err, "topic orders")
	// A payload just under the limit (metadata included) is stored.
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "orders", AggregateID: "o-2", Payload: big[:outbox.DefaultMaxEventBytes-1024]}))
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, count(t, b.db, "aggregate_id = 'o-2'"))
	require.Zero(t, count(t, b.db, "aggregate_id = 'o-1'"))
}

// A relay that stops answering while it holds the wake-up lock (a hung
// process, a half-open connection) must not keep writers notifying for
// good: the server ends the holding session once it has been idle for
// holdTimeout, which frees the lock, and the relay takes it again on a new
// connection.
func TestRelay_HungHolderLosesTheWakeupLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var version int
	require.NoError(t, b.db.QueryRow(`SELECT current_setting('server_version_num')::int`).Scan(&version))
	if version < 140000 {
		t.Skip("idle_session_timeout needs Postgres 14")
	}
	r, err := New(postgres.From(b.db), b.pubsub, Config{ListenURL: b.schema.URL, PollInterval: time.Millisecond})
	require.NoError(t, err)
	ctx := context.Background()
	stop, err := r.listen(ctx, make(chan struct{}, 1))
	require.NoError(t, err)
	defer stop()
	require.True(t, r.holdGuard)
	held := func() bool { return wakeupLockHolder(t, b) != 0 }
	_, settled, err := r.announceIdle(ctx) // and never released: hung
	require.NoError(t, err)
	require.True(t, settled)
	require.True(t, held())
	eventually(t, 4*r.holdTimeout(), func() bool { return !held() }, "the server ends the idle holder's session")
	eventually(t, 30*time.Second, func() bool {
		release, settled, err := r.announceIdle(ctx) // the first try may meet the ended session
		if err != nil || !settled || !held() {
			return false
		}
		release(false)
		return !held()
	}, "the relay takes and releases the lock again")
}

// listenNotifications LISTENs on the test schema's outbox channel and
// returns a function that sends a marker notification and one that
// returns the next notification's payload. Notifications reach a listener
// in commit order, so a marker sent after some writes shows whether they
// notified.
func listenNotifications(t *testing.T, b bundle) (marker func(string), next func() string) {
	t.Helper()
	var schema string
	require.NoError(t, b.db.QueryRow(`SELECT current_schema()`).Scan(&schema))
	l := pq.NewListener(b.schema.URL, time.Millisecond, time.Second, nil)
	t.Cleanup(func() { _ = l.Close() })
	require.NoError(t, l.Listen(NotifyChannel(schema)))
	marker = func(name string) {
		_, err := b.db.Exec(`SELECT pg_notify($1, $2)`, NotifyChannel(schema), name)
		require.NoError(t, err)
	}
	next = func() string {
		select {
		case n := <-l.NotificationChannel():
			require.NotNil(t, n)
			return n.Extra
		case <-time.After(10 * time.Second):
			t.Fatal("no notification")
			return ""
		}
	}
	return marker, next
}

// wakeupLockHolder returns the pid of the session holding the test
// schema's wake-up lock, 0 when none does.
func wakeupLockHolder(t *testing.T, b bundle) int {
	t.Helper()
	var pid int
	err := b.db.QueryRow(`SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 AND objid = $2 AND granted`,
		wakeLockClass, tableOID(t, b.db)).Scan(&pid)
	if errors.Is(err, sql.ErrNoRows) {
		return 0
	}
	require.NoError(t, err)
	return pid
}

// triedWakeupLock reports how many sessions last ran the wake-up lock's try
// for the test schema's outbox: relays that went idle.
func triedWakeupLock(t *testing.T, b bundle) int {
	t.Helper()
	try := fmt.Sprintf("%%pg_try_advisory_lock(%d, %d)%%", wakeLockClass, int32(tableOID(t, b.db)))
	var n int
	require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE $1 AND pid <> pg_backend_pid()`, try).Scan(&n))
	return n
}

// A relay whose look under the wake-up lock finds work gives the lock back
// before publishing: writers must not notify (serialising their commits)
// while it is busy.
func TestRelay_PublishesWithoutHoldingTheWakeupLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	marker, next := listenNotifications(t, b)
	ctx := context.Background()
	entered, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
		if string(m.Payload) == `"slow"` {
			once.Do(func() { close(entered); <-proceed })
		}
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{ListenURL: b.schema.URL, PollInterval: time.Hour})
	require.NoError(t, err)
	var planted sync.Once
	r.beforeIdleLook = func() {
		// The relay holds the lock now; an event committed without the
		// trigger (replica role) is what its look finds.
		planted.Do(func() {
			tx, err := b.db.BeginTx(ctx, nil)
			require.NoError(t, err)
			_, err = tx.Exec(`SET LOCAL session_replication_role = replica`)
			require.NoError(t, err)
			require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "t", AggregateID: "a", Payload: []byte(`"slow"`)}))
			require.NoError(t, tx.Commit())
		})
	}
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-errc)
	})
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(proceed) }) }) // runs first, also on failure
	select {
	case <-entered: // the relay is publishing what its look under the lock found
	case err := <-errc:
		t.Fatalf("relay stopped before publishing the planted event: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not publish the event its look under the lock found within 10s")
	}
	// Skip what was notified before: the relay's own notification when it
	// joined (waking relays that hold its share).
	marker("before")
	for next() != "before" {
	}
	for i := 0; i < 3; i++ {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: fmt.Sprint("w", i)}))
	}
	marker("m")
	require.Equal(t, "m", next(), "writers notified while the relay was publishing")
}

// A relay that stops while it holds the wake-up lock hands it over: the
// other relays, asleep because it held the lock, wake and one takes it, so
// the next event is not left to their poll.
func TestRelay_StoppingHolderHandsOverTheWakeup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "t")
	// Lease 3m: an idle relay also wakes after a third of its lease (10 s
	// by default, 5 s after these waits' old 5 s ceilings); with 60 s the 30 s
	// ceilings below still tell a wake-up from that timer on a loaded machine.
	cfg := Config{ListenURL: b.schema.URL, PollInterval: time.Hour, Lease: 3 * time.Minute}
	relays := []*Relay{startRelay(t, b.db, b.pubsub, cfg), startRelay(t, b.db, b.pubsub, cfg)}
	// Both are idle: one holds the lock, the other found it held. Until
	// they have divided the lanes they wake every few ms and the lock may
	// change hands; once each holds its 32 it stays where it is.
	divided := func() bool {
		var owners, min int
		require.NoError(t, b.db.QueryRow(`SELECT count(*), coalesce(min(n), 0) FROM (SELECT count(*) AS n
			FROM millwright_outbox_lanes WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner) o`).Scan(&owners, &min))
		return owners == 2 && min == laneCount/2
	}
	var seen string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last seen: %s", seen)
		}
	})
	// The holder is found in the same look that sees both idle: a relay
	// woken by a late notification (the other's join) gives the lock up
	// for a moment, so a second look may find nobody holding it.
	var holder *Relay
	eventually(t, 30*time.Second, func() bool {
		d, tried, h := divided(), triedWakeupLock(t, b), wakeupLockHolder(t, b)
		seen = fmt.Sprintf("lanes divided %v, relays idle %d, lock holder pid %d", d, tried, h)
		if !d || tried != 2 || h == 0 {
			return false
		}
		for _, r := range relays {
			var pid int
			require.NoError(t, r.waitDB.QueryRow(context.Background(), storage.S(`SELECT pg_backend_pid()`), &pid))
			if pid == h {
				holder = r
			}
		}
		return holder != nil
	}, "both relays idle with their lanes, one of them holding the lock")
	require.NoError(t, holder.Close())
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "the other relay publishes without waiting for its poll")
}

// A relay that joins while another sleeps holding every lane (PollInterval
// an hour, so the sleeper would wake only after a third of Lease: 60 s
// here, 10 s by default, which left a 3 s wait 7 s of margin) gets its
// share at once: it wakes the sleeper, which checks its lanes first and
// frees that share.
func TestRelay_JoiningRelayWakesTheSleepingHolder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := Config{ListenURL: b.schema.URL, PollInterval: time.Hour, Lease: 3 * time.Minute}
	startRelay(t, b.db, b.pubsub, cfg)
	heldBy := func() []int {
		return pgtest.Column[int](t, b.db, `SELECT count(*) FROM millwright_outbox_lanes
			WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner ORDER BY 1`)
	}
	eventually(t, 30*time.Second, func() bool {
		return slices.Equal(heldBy(), []int{laneCount}) && triedWakeupLock(t, b) == 1
	}, "the first relay holds every lane and sleeps")
	start := time.Now()
	startRelay(t, b.db, b.pubsub, cfg)
	eventually(t, 30*time.Second, func() bool { return slices.Equal(heldBy(), []int{laneCount / 2, laneCount / 2}) },
		"the relays divide the lanes well before the sleeper's own wake-up")
	t.Logf("lanes divided %s after the second relay started", time.Since(start))
}
