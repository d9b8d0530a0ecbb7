package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// leaseBundle is a schema whose marks are logged (marksBy) and a RabbitMQ
// topic with a consumer recording what arrives, for the tests of a
// publish bounded by its lanes' lease.
type leaseBundle struct {
	s     *pgtest.Schema
	topic string
	group string
	got   *arrivals
}

func leaseSetup(t *testing.T) leaseBundle {
	t.Helper()
	s := pgtest.New(t, outbox.Migrations())
	// Who marked each row published: the marking session's
	// application_name (each relay has its own pool, named).
	_, err := s.DB.Exec(`CREATE TABLE marks (id bigint, by_app text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION log_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO marks (id, by_app) VALUES (NEW.id, current_setting('application_name')); RETURN NEW; END $$;
CREATE TRIGGER log_mark AFTER UPDATE ON millwright_outbox FOR EACH ROW
	WHEN (OLD.status = 'pending' AND NEW.status = 'published') EXECUTE FUNCTION log_mark();`)
	require.NoError(t, err)
	b := leaseBundle{s: s, topic: "outbox_lease_" + watermill.NewShortUUID(), group: "lease-test"}
	transporttest.DeleteAMQPTopology(t, []string{b.topic}, b.group)
	direct := openAMQP(t, transporttest.AMQPURL(), b.group)
	sub, err := direct.Subscriber(b.group)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(ctx, b.topic)
	require.NoError(t, err)
	b.got = &arrivals{}
	go func() {
		for m := range msgs {
			b.got.add(m)
			m.Ack()
		}
	}()
	return b
}

// openAMQP opens millwright's AMQP transport on url, declaring group's
// queue before the first publish.
func openAMQP(t *testing.T, url, group string) *amqp.Transport {
	t.Helper()
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: url, DeclareGroups: []string{group}, ConnectTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

// amqpProxy starts a faultproxy to the test broker and returns it with the
// broker's URL through it.
func amqpProxy(t *testing.T) (*faultproxy.Proxy, string) {
	t.Helper()
	p, through, err := faultproxy.Through(transporttest.AMQPURL(), "5672")
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, through
}

// appDB opens a pool on the schema whose sessions are named app (see
// marksBy).
func appDB(t *testing.T, s *pgtest.Schema, app string) *sql.DB {
	t.Helper()
	u, err := url.Parse(s.URL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	db, err := sql.Open("postgres", u.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// marksBy counts the rows marked published by sessions named app.
func (b leaseBundle) marksBy(t *testing.T, app string) int {
	t.Helper()
	var n int
	require.NoError(t, b.s.DB.QueryRow(`SELECT count(*) FROM marks WHERE by_app = $1`, app).Scan(&n))
	return n
}

// addEvents writes perAgg events for each of aggs aggregates, each in
// its own transaction, aggregates interleaved.
func (b leaseBundle) addEvents(t *testing.T, aggs, perAgg int) int {
	t.Helper()
	for seq := 1; seq <= perAgg; seq++ {
		for a := range aggs {
			agg := fmt.Sprintf("agg-%02d", a)
			require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(b.s.DB), outbox.Event{Topic: b.topic, AggregateType: "lease", AggregateID: agg,
				Payload: []byte(fmt.Sprintf(`{"agg":%q,"seq":%d}`, agg, seq))}))
		}
	}
	return aggs * perAgg
}

// arrivals records the messages a consumer received, in order.
type arrivals struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (a *arrivals) add(m *message.Message) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.msgs = append(a.msgs, m)
}

// firstDeliveries checks that each aggregate's events arrived, counting
// each event once (its first delivery), in order 1, 2, ..., and returns
// how many distinct events and deliveries arrived.
func (a *arrivals) firstDeliveries(t *testing.T) (events, deliveries int) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	seen := map[string]bool{}
	last := map[string]int{}
	var trace []string
	for _, m := range a.msgs {
		var ev struct {
			Agg string `json:"agg"`
			Seq int    `json:"seq"`
		}
		require.NoError(t, json.Unmarshal(m.Payload, &ev), "payload of %s", m.UUID)
		trace = append(trace, fmt.Sprintf("%s/%d", ev.Agg, ev.Seq))
		if seen[m.UUID] {
			continue
		}
		seen[m.UUID] = true
		require.Equal(t, last[ev.Agg]+1, ev.Seq, "aggregate %s: first deliveries out of order; arrivals: %v", ev.Agg, trace)
		last[ev.Agg] = ev.Seq
	}
	return len(seen), len(a.msgs)
}

// callLog wraps a relay's publisher and records each broker call: which
// events it carried, when it began and when it returned.
type callLog struct {
	pub message.Publisher
	// ignoreCtx makes the calls wait as a publisher that does not stop at
	// its messages' context would: each message's context is replaced by
	// one that is never done.
	ignoreCtx bool

	mu    sync.Mutex
	calls []call
}

type call struct {
	ids        []string
	begin, end time.Time // end zero: still running
}

func (c *callLog) Publish(topic string, msgs ...*message.Message) error {
	return c.record(msgs, func() error { return c.pub.Publish(topic, msgs...) })
}

func (c *callLog) PublishBatch(topic string, msgs ...*message.Message) error {
	return c.record(msgs, func() error { return c.pub.(batch.Publisher).PublishBatch(topic, msgs...) })
}

func (c *callLog) Close() error { return nil }

func (c *callLog) record(msgs []*message.Message, send func() error) error {
	if c.ignoreCtx {
		for _, m := range msgs {
			m.SetContext(context.Background())
		}
	}
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	c.mu.Lock()
	k := len(c.calls)
	c.calls = append(c.calls, call{ids: ids, begin: time.Now()})
	c.mu.Unlock()
	err := send()
	c.mu.Lock()
	c.calls[k].end = time.Now()
	c.mu.Unlock()
	return err
}

// snapshot returns the calls so far.
func (c *callLog) snapshot() []call {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.calls)
}

// returned reports whether at least one call began and every call has
// returned.
func (c *callLog) returned() bool {
	calls := c.snapshot()
	for _, k := range calls {
		if k.end.IsZero() {
			return false
		}
	}
	return len(calls) > 0
}

// requireBefore checks that every call of a carrying an event that a call
// of b carries returned before b's first call carrying it began: the two
// relays never had the event in flight at once.
func requireBefore(t *testing.T, a, b []call) {
	t.Helper()
	firstB := map[string]time.Time{}
	for _, k := range b {
		for _, id := range k.ids {
			if f, ok := firstB[id]; !ok || k.begin.Before(f) {
				firstB[id] = k.begin
			}
		}
	}
	for _, k := range a {
		for _, id := range k.ids {
			f, ok := firstB[id]
			if !ok {
				continue
			}
			require.False(t, k.end.IsZero(), "event %s: the first relay's call is still running", id)
			require.True(t, k.end.Before(f), "event %s: the first relay's call (%s to %s) was still running when the second relay's began (%s)",
				id, k.begin.Format(time.StampMicro), k.end.Format(time.StampMicro), f.Format(time.StampMicro))
		}
	}
}

// runRelay runs r until the test ends (or stop is called) and returns
// stop, which closes it and checks Run's error.
func runRelay(t *testing.T, r *Relay) (stop func()) {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			require.NoError(t, r.Close())
			select {
			case err := <-errc:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("relay still running 30s after Close")
			}
		})
	}
	t.Cleanup(stop)
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("relay not running after 10s")
	}
	return stop
}

// ownsLanes counts the lanes owner holds under a live lease.
func ownsLanes(t *testing.T, db *sql.DB, owner string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox_lanes WHERE owner = $1 AND lease_until > now()`, owner).Scan(&n))
	return n
}

// A broker that stops confirming (RabbitMQ under a memory alarm, which
// stops reading from publishing connections; here a proxy holding back
// everything the broker sends the first relay) does not hold a batch's
// publish past the lease of the lanes it was claimed under: the publish
// stage ends shortly before the lease, while the relay still holds the
// lanes, the rows stay pending with no failure counted, and once the
// lanes change hands the second relay publishes them. The first relay
// sends nothing more (the proxy counts its bytes: a channel close at
// most), and its call, which waits for the broker's answer to that close
// (millwright's AMQP publisher closes a channel left with confirms owed,
// and amqp091 waits for the broker's close-ok without a context), is left
// running and counted; when the replies come, it marks nothing. At the
// consumer each aggregate's first deliveries are in order.
func TestRelay_PublishEndsBeforeItsLanesLease(t *testing.T) {
	t.Parallel()
	b := leaseSetup(t)
	total := b.addEvents(t, 5, 4)
	proxy, through := amqpProxy(t)
	trA := warmAMQP(t, through, b)
	trB := openAMQP(t, transporttest.AMQPURL(), b.group)
	logA := &callLog{pub: trA.Publisher()}

	const lease = 5 * time.Second
	cfg := Config{Lease: lease, PollInterval: 20 * time.Millisecond, BatchSize: 100}
	a, err := New(postgres.From(appDB(t, b.s, "relay-a")), logA, cfg)
	require.NoError(t, err)
	type markStage struct {
		published []int64
		heldLanes int   // lanes a still held under a live lease then
		sent      int64 // bytes a had sent through the proxy by then
	}
	marks := make(chan markStage, 1)
	a.afterPublish = func(_ context.Context, published []int64) {
		marks <- markStage{published, ownsLanes(t, b.s.DB, a.id+"/once"), proxy.ClientBytes()}
	}
	proxy.Hold()
	type once struct {
		n   int
		err error
	}
	done := make(chan once, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	began := time.Now()
	go func() { n, err := a.RunOnce(ctx); done <- once{n, err} }()
	var first markStage
	select {
	case first = <-marks:
	case <-time.After(30 * time.Second):
		t.Fatalf("the first relay's publish never ended (calls %d, replies held %d)", len(logA.snapshot()), proxy.HeldReads())
	}
	ended := time.Since(began)
	res := <-done
	require.ErrorIs(t, res.err, errLeaseEnded, "the publish did not end by the lease bound")
	require.Equal(t, total, res.n)
	require.Positive(t, proxy.HeldReads(), "the proxy held no reply: the broker's confirms were not held")
	require.Empty(t, first.published, "rows counted as published although their confirms were held")
	require.Positive(t, first.heldLanes, "the publish ended after the relay lost its lanes")
	require.Less(t, ended, lease, "the publish stage lasted a whole lease")
	require.EqualValues(t, 1, a.cutBatches.Load())
	running := 0
	for _, k := range logA.snapshot() {
		if k.end.IsZero() {
			running++
		}
	}
	require.EqualValues(t, running, a.stuck.Load(), "calls left running are counted")
	require.Equal(t, total, count(t, b.s.DB, "status = 'pending' AND retry_count = 0 AND first_failed_at IS NULL"),
		"the rows whose publish was cut must stay pending as they were (no failure recorded)")

	// The lanes change hands (RunOnce gave them back).
	rb, err := New(postgres.From(appDB(t, b.s, "relay-b")), trB.Publisher(), cfg)
	require.NoError(t, err)
	runRelay(t, rb)
	eventually(t, 60*time.Second, func() bool { return count(t, b.s.DB, "status = 'published'") == total },
		"the second relay did not publish the rows")
	eventually(t, 30*time.Second, func() bool { ev, _ := b.got.firstDeliveries(t); return ev == total+1 }, "not every event arrived")
	after := proxy.ClientBytes() - first.sent
	require.Less(t, after, int64(200), "the first relay sent %d bytes after its publish stage ended: more than a channel close and heartbeats", after)

	proxy.Release()
	eventually(t, 30*time.Second, func() bool { return a.stuck.Load() == 0 && logA.returned() }, "the first relay's call never returned after the release")
	require.Zero(t, b.marksBy(t, "relay-a"), "the first relay marked rows")
	require.Equal(t, total, b.marksBy(t, "relay-b"))
	events, deliveries := b.got.firstDeliveries(t)
	t.Logf("%d events (with the warm-up), %d deliveries; the first relay's stage ended after %s, left %d call(s) running, sent %d bytes after; replies held: %d",
		events, deliveries, ended, running, after, proxy.HeldReads())
}

// warmAMQP opens millwright's AMQP transport on url with one channel and
// publishes one message (warmup/1) to b's topic on it, so that its
// channel is open and the topic declared before a test holds the broker's
// replies: opening a channel and declaring wait for the broker's answer
// without a context, and a test of the confirms' wait wants only that.
func warmAMQP(t *testing.T, url string, b leaseBundle) *amqp.Transport {
	t.Helper()
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: url, DeclareGroups: []string{b.group}, ChannelPoolSize: 1, ConnectTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	require.NoError(t, tr.Publisher().Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte(`{"agg":"warmup","seq":1}`))))
	return tr
}

// A publisher that does not stop at its messages' context (a client
// library waiting for a confirm regardless) cannot be cut short: the
// relay stops waiting at the bound, and while the call still runs it
// holds no lanes (it frees them and leaves the relays' table), so another
// relay publishes its rows. When the held confirms finally arrive, the
// late call's results are dropped: the first relay marks nothing. It
// takes lanes again once the call has returned.
func TestRelay_StandsAsideWhileACallOutlivesItsBound(t *testing.T) {
	t.Parallel()
	b := leaseSetup(t)
	total := b.addEvents(t, 5, 4)
	proxy, through := amqpProxy(t)
	trA := warmAMQP(t, through, b)
	trB := openAMQP(t, transporttest.AMQPURL(), b.group)
	logA := &callLog{pub: trA.Publisher(), ignoreCtx: true}
	logB := &callLog{pub: trB.Publisher()}

	cfg := Config{Lease: 5 * time.Second, PollInterval: 20 * time.Millisecond, BatchSize: 100}
	a, err := New(postgres.From(appDB(t, b.s, "relay-a")), logA, cfg)
	require.NoError(t, err)
	proxy.Hold()
	runRelay(t, a)
	eventually(t, 30*time.Second, func() bool { return a.stuck.Load() > 0 }, "the first relay never stopped waiting for its stuck call")
	require.Positive(t, proxy.HeldReads(), "the proxy held no reply")
	eventually(t, 30*time.Second, func() bool {
		var member int
		require.NoError(t, b.s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox_relays WHERE id = $1`, a.id).Scan(&member))
		return ownsLanes(t, b.s.DB, a.id) == 0 && member == 0
	}, "the relay with a stuck call still holds lanes")
	require.False(t, logA.returned(), "the call returned: it was not stuck")
	require.Equal(t, total, count(t, b.s.DB, "status = 'pending' AND retry_count = 0"))

	rb, err := New(postgres.From(appDB(t, b.s, "relay-b")), logB, cfg)
	require.NoError(t, err)
	runRelay(t, rb)
	eventually(t, 60*time.Second, func() bool { return count(t, b.s.DB, "status = 'published'") == total },
		"the second relay did not publish the rows")
	require.Positive(t, a.stuck.Load(), "the call returned before the confirms were released")
	require.Zero(t, ownsLanes(t, b.s.DB, a.id), "the relay with a stuck call took lanes")

	proxy.Release()
	eventually(t, 30*time.Second, func() bool { return a.stuck.Load() == 0 && logA.returned() }, "the stuck call never returned after the release")
	eventually(t, 30*time.Second, func() bool { return ownsLanes(t, b.s.DB, a.id) > 0 }, "the first relay did not take lanes again after its call returned")
	require.Zero(t, b.marksBy(t, "relay-a"), "the first relay's late confirms marked rows")
	require.Equal(t, total, b.marksBy(t, "relay-b"))
	eventually(t, 30*time.Second, func() bool { ev, _ := b.got.firstDeliveries(t); return ev == total+1 }, "not every event arrived")
}

// The marks write only rows of lanes the relay still holds: a relay
// whose lanes changed hands between its publish and its mark (stalled
// past its lease, say) marks nothing published, records no failure and
// sends no dead letter; the lanes' new holder publishes the rows.
func TestRelay_MarksOnlyLanesItStillHolds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	got := b.collect(t, "orders")
	dead := b.collect(t, "orders.dead")
	for i := range 3 {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "ok", Payload: []byte(fmt.Sprintf(`{"i":%d}`, i))}))
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "bad", Payload: []byte(`{}`)}))
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
		if m.Metadata.Get(metadata.AggregateID) == "bad" {
			return fmt.Errorf("refused")
		}
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{DeadLetterTopic: "orders.dead", Retry: retryOnce})
	require.NoError(t, err)
	stolen := 0
	r.afterPublish = func(ctx context.Context, published []int64) {
		// Another relay takes the lanes (as after this one's lease ran
		// out) before the mark.
		res, err := b.schema.DB.Exec(`UPDATE millwright_outbox_lanes SET owner = 'another-relay', lease_until = now() + interval '1 hour' WHERE owner IS NOT NULL`)
		require.NoError(t, err)
		n, _ := res.RowsAffected()
		stolen = int(n)
	}
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, n)
	require.Positive(t, stolen, "no lane was taken from the relay")
	require.Len(t, got.all(), 3, "the publish happened")
	require.Equal(t, 4, count(t, b.db, "status = 'pending' AND retry_count = 0"), "the relay wrote rows of lanes it no longer held")
	require.Empty(t, dead.all(), "a dead letter for a row whose failure was not recorded")
}
