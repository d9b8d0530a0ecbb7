package relay

import (
	"context"
	"database/sql"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	tsql "github.com/millwright/millwright/transport/sql"
)

func inDatabaseBundle(t *testing.T) (*pgtest.Schema, *tsql.Transport) {
	t.Helper()
	s := pgtest.New(t, outbox.Migrations())
	s.DB.SetMaxOpenConns(10)
	tr, err := tsql.Open(context.Background(), tsql.Config{DB: s.DB}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return s, tr
}

// TestMove_StalledRelayLosesItsBatchAfterLease: a relay stops in the
// middle of its in-database publish, rows claimed and copied, transaction
// open. While it holds their lane no other relay publishes the rows; after
// Lease the server ends its transaction, so its copy never commits, and
// the rows, still pending, are published once, by the next relay to hold
// their lane: the stalled one, when it resumes, claims nothing more under
// the lease that ended (see Config.Lease).
func TestMove_StalledRelayLosesItsBatchAfterLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	topic := "stall_" + watermill.NewShortUUID()
	for i := range 5 {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", Payload: []byte(`{"i":` + string(rune('0'+i)) + `}`)}))
	}

	stalled, err := New(postgres.From(s.DB), tr.Publisher(), Config{Lease: 500 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, stalled.mover.prepareTopics(ctx, []string{topic}))
	other, err := New(postgres.From(s.DB), tr.Publisher(), Config{})
	require.NoError(t, err)
	resume := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(resume) }) }
	t.Cleanup(release) // before the schema is dropped: never leave the stalled relay holding locks
	claimed := make(chan struct{})
	stalled.mover.beforeCommit = func() { close(claimed); <-resume }
	stalledDone := make(chan int, 1)
	go func() { n, _ := stalled.RunOnce(ctx); stalledDone <- n }()
	select {
	case <-claimed:
	case n := <-stalledDone:
		t.Fatalf("the stalled relay returned (%d rows) without publishing in the database", n)
	case <-time.After(30 * time.Second):
		t.Fatal("the stalled relay never claimed in the database")
	}

	n, err := other.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "the stalled relay holds the rows' lane")
	poll.Until(t, 30*time.Second, func() bool {
		// The rows' locks go with the transaction the server ends.
		var free int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM (SELECT 1 FROM millwright_outbox FOR UPDATE SKIP LOCKED) x`).Scan(&free))
		return free == 5
	}, "the server never ended the stalled relay's transaction")
	release()
	require.Zero(t, <-stalledDone, "its copy did not commit, and its lease had ended: it claims nothing through the publisher")
	require.Equal(t, 5, count(t, s.DB, "status = 'pending'"))
	n, err = other.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, n, "the rows, still pending, go out with the lane's next holder")

	var copies, published int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM "watermill_`+topic+`"`).Scan(&copies, &published))
	require.Equal(t, 5, copies)
	require.Equal(t, 5, published)
	require.Zero(t, count(t, s.DB, "status <> 'published'"))
}

// TestMove_RowsBehindABackingOffHeadWait: rows written behind an
// aggregate's event that backs off after a failure are due but wait for
// it; other aggregates go out.
func TestMove_RowsBehindABackingOffHeadWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	topic := "held_" + watermill.NewShortUUID()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", Payload: []byte(`{}`)}))
	_, err := s.DB.Exec(`UPDATE millwright_outbox SET next_attempt_at = now() + interval '1 hour', retry_count = 1`)
	require.NoError(t, err)
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "a", Payload: []byte(`{}`)}))
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateID: "b", Payload: []byte(`{}`)}))

	r, err := New(postgres.From(s.DB), tr.Publisher(), Config{})
	require.NoError(t, err)
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "only b's event goes out")
	require.Equal(t, 1, count(t, s.DB, "status = 'published' AND aggregate_id = 'b'"))
	require.Equal(t, 2, count(t, s.DB, "status = 'pending' AND aggregate_id = 'a'"))

	_, err = s.DB.Exec(`UPDATE millwright_outbox SET next_attempt_at = now() WHERE retry_count = 1`)
	require.NoError(t, err)
	n, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "once the head is due, the aggregate goes out")
}

// TestSameDatabase: two pools on one database (different search paths)
// are the same database; a pool on another database of the same server is
// not.
func TestSameDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, outbox.Migrations())
	base, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = base.Close() })
	same, err := sameDatabase(ctx, storage.NewSQL(s.DB), storage.NewSQL(base))
	require.NoError(t, err)
	require.True(t, same)

	tokyo, err := url.Parse(s.URL)
	require.NoError(t, err)
	q := tokyo.Query()
	q.Set("timezone", "Asia/Tokyo") // lib/pq sends unknown parameters as session settings
	tokyo.RawQuery = q.Encode()
	other, err := sql.Open("postgres", tokyo.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close() })
	var tz string
	require.NoError(t, other.QueryRowContext(ctx, `SHOW TimeZone`).Scan(&tz))
	require.Equal(t, "Asia/Tokyo", tz)
	same, err = sameDatabase(ctx, storage.NewSQL(s.DB), storage.NewSQL(other))
	require.NoError(t, err)
	require.True(t, same, "the session's TimeZone does not change the database")

	u, err := url.Parse(pgtest.BaseURL())
	require.NoError(t, err)
	u.Path = "/template1" // in every cluster, open to connections by default
	template, err := sql.Open("postgres", u.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = template.Close() })
	if err := template.PingContext(ctx); err != nil {
		t.Skipf("no second database to compare with: %v", err)
	}
	same, err = sameDatabase(ctx, storage.NewSQL(s.DB), storage.NewSQL(template))
	require.NoError(t, err)
	require.False(t, same)
}

// Relays publishing in the database lend lanes too (their claim returns
// each row's lane): a backlog all in one relay's share is drained by
// both, and each aggregate's events land in its topic's table in order.
func TestMove_SpareMoverDrainsLanesLentToIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	const events = 20000
	fillEvenLanes(t, s.DB, events)
	cfg := Config{BatchSize: 200, PollInterval: 5 * time.Millisecond, Lease: 5 * time.Second}
	var relays []*Relay
	for range 2 {
		r := startRelay(t, s.DB, tr.Publisher(), cfg)
		require.NoError(t, r.mover.prepareTopics(ctx, []string{"t"}))
		relays = append(relays, r)
	}
	poll.Until(t, 2*time.Minute, func() bool { return count(t, s.DB, "status = 'pending'") == 0 }, "drain")
	lent := relays[0].lanesLent.Load() + relays[1].lanesLent.Load()
	require.Positive(t, lent, "lanes were lent")
	for i, r := range relays {
		require.Greater(t, r.Stats().Published, uint64(events/10), "relay %d published a real part of the backlog", i)
	}
	t.Logf("lanes lent: %d; published by each relay: %d and %d", lent, relays[0].Stats().Published, relays[1].Stats().Published)
	// Each aggregate's events in the topic's table in the order written.
	rows, err := s.DB.Query(`SELECT o.aggregate_id, o.payload::text::int FROM "watermill_t" w
		JOIN millwright_outbox o ON o.event_id = w.uuid ORDER BY w."offset"`)
	require.NoError(t, err)
	defer rows.Close()
	last := map[string]int{}
	n := 0
	for rows.Next() {
		var agg string
		var g int
		require.NoError(t, rows.Scan(&agg, &g))
		if prev, ok := last[agg]; ok {
			require.Greater(t, g, prev, "aggregate %s out of order", agg)
		}
		last[agg] = g
		n++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, events, n, "every event moved once")
}

// preparesCounter counts the PrepareTopic calls made on an in-database
// publisher.
type preparesCounter struct {
	sqlschema.Publisher
	prepares atomic.Int64
}

func (p *preparesCounter) PrepareTopic(ctx context.Context, topic string) error {
	p.prepares.Add(1)
	return p.Publisher.PrepareTopic(ctx, topic)
}

// A relay whose publisher already prepared a topic (for another relay)
// moves its first batch of that topic at once: it neither prepares the
// topic again nor claims the batch twice (a claim, rolled back, then the
// preparation, then the claim again).
func TestMove_TopicPreparedForAnotherRelayMovesAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	pub := &preparesCounter{Publisher: tr.Publisher().(sqlschema.Publisher)}
	add := func(n int) {
		evs := make([]outbox.Event, n)
		for i := range evs {
			evs[i] = outbox.Event{Topic: "t", AggregateType: "order", AggregateID: strconv.Itoa(i), EventType: "order.created.v1", Payload: []byte(`{}`)}
		}
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), evs...))
	}
	first, err := New(postgres.From(s.DB), pub, Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = first.Close() })
	add(10)
	n, err := first.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 10, n)
	require.EqualValues(t, 1, pub.prepares.Load(), "the first relay prepared the topic")

	second, err := New(postgres.From(s.DB), pub, Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = second.Close() })
	require.False(t, second.mover.prepared("u"), "a topic nobody prepared")
	add(10)
	n, err = second.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 10, n)
	require.EqualValues(t, 1, pub.prepares.Load(), "the second relay used the topic as prepared")
	require.Zero(t, count(t, s.DB, "status = 'pending'"))
	var moved int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) FROM "watermill_t"`).Scan(&moved))
	require.Equal(t, 20, moved, "both batches were published in the database")
}
