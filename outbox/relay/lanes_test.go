package relay

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// recorder is a publisher that keeps every message it accepts, in order.
type recorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *recorder) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *recorder) Close() error { return nil }

func (p *recorder) all() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.msgs...)
}

// fillBacklog writes n events in one statement: event g (0..n-1) has
// payload g and belongs to aggregate "hot" when hot and g%10 == 0 (10% of
// the events), else to one of aggregates; ids follow g.
func fillBacklog(t *testing.T, b bundle, n, aggregates int, hot bool) {
	t.Helper()
	_, err := b.db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, payload)
		SELECT gen_random_uuid()::text, 't', 'acct',
			CASE WHEN $3 AND g % 10 = 0 THEN 'hot' ELSE 'a' || (g % $2) END, to_jsonb(g)
		FROM generate_series(0, $1 - 1) g ORDER BY g`, n, aggregates, hot)
	require.NoError(t, err)
	_, err = b.db.Exec(`ANALYZE millwright_outbox`)
	require.NoError(t, err)
}

// checkBacklogOrder asserts that every event arrived and, dropping
// duplicates, each aggregate's events arrived in the order written.
func checkBacklogOrder(t *testing.T, msgs []*message.Message, n int) {
	t.Helper()
	last := map[string]int{}
	distinct := firstDeliveries(t, msgs, func(agg string, g int) {
		if prev, ok := last[agg]; ok {
			require.Greater(t, g, prev, "aggregate %s out of order", agg)
		}
		last[agg] = g
	})
	require.Equal(t, n, distinct, "every event published")
}

// N relays drain backlogs spread over many or few aggregates, with a hot
// one, while relays crash (their lanes wait out the lease, then the
// others republish what they had not marked) and new ones join: no event
// is lost and no aggregate is reordered.
func TestRelay_LanesKeepOrderAcrossCrashes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		events     int
		aggregates int
		hot        bool
	}{
		{"1000 aggregates", 20000, 1000, false},
		{"100000 aggregates", 100000, 100000, false},
		{"one hot aggregate with 10%", 20000, 1000, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			fillBacklog(t, b, tc.events, tc.aggregates, tc.hot)
			pub := &recorder{}
			cfg := Config{BatchSize: 500, PollInterval: 5 * time.Millisecond, Lease: 300 * time.Millisecond}
			// Three relays; each of the first two crashes after its
			// third batch reached the broker, before marking it, and a
			// new relay replaces it.
			var crashes atomic.Int64
			start := func(crash bool) {
				r, err := New(postgres.From(b.db), pub, cfg)
				require.NoError(t, err)
				ctx, cancel := context.WithCancel(context.Background())
				if crash {
					// The relay's lane groups mark at once: count atomically.
					var batches atomic.Int64
					r.afterPublish = func(context.Context, []int64) {
						if batches.Add(1) == 3 {
							r.crashed.Store(true)
							crashes.Add(1)
							cancel()
						}
					}
				}
				done := make(chan error, 1)
				go func() { done <- r.Run(ctx) }()
				t.Cleanup(func() {
					cancel()
					require.NoError(t, <-done)
				})
			}
			start(true)
			start(true)
			start(false)
			eventually(t, 10*time.Second, func() bool { return crashes.Load() == 2 }, "two relays crash")
			start(false)
			start(false)
			eventually(t, 3*time.Minute, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
			msgs := pub.all()
			checkBacklogOrder(t, msgs, tc.events)
			require.Greater(t, len(msgs), tc.events, "the crashed relays' unmarked batches went out again")
		})
	}
}

// Relays that join and leave divide the lanes between them: each running
// relay holds its share, every lane is held once.
func TestRelay_RelaysDivideTheLanes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	held := func() map[string]int {
		rows, err := b.db.Query(`SELECT owner, count(*) FROM millwright_outbox_lanes WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner`)
		require.NoError(t, err)
		defer rows.Close()
		out := map[string]int{}
		for rows.Next() {
			var owner string
			var n int
			require.NoError(t, rows.Scan(&owner, &n))
			out[owner] = n
		}
		require.NoError(t, rows.Err())
		return out
	}
	shares := func(relays int) bool {
		h := held()
		total := 0
		for _, n := range h {
			total += n
			if n < laneCount/relays || n > laneCount/relays+1 {
				return false
			}
		}
		return len(h) == relays && total == laneCount
	}
	var rs []*Relay
	for i := range 4 {
		rs = append(rs, startRelay(t, b.db, &recorder{}, Config{PollInterval: 5 * time.Millisecond}))
		eventually(t, 10*time.Second, func() bool { return shares(i + 1) }, fmt.Sprintf("%d relay(s) share the lanes", i+1))
	}
	require.NoError(t, rs[0].Close())
	eventually(t, 10*time.Second, func() bool { return shares(3) }, "a stopped relay's lanes go to the others")
}

// Relays started together divide the lanes from their first claim: a
// running relay's first check only announces it, so the first of them does
// not take every lane and hand most back a round later.
func TestLanes_RelaysStartedTogetherTakeOnlyTheirShare(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ls := []*lanes{
		{db: storage.NewSQL(b.db), id: "relay-a", lease: time.Minute, member: true},
		{db: storage.NewSQL(b.db), id: "relay-b", lease: time.Minute, member: true},
	}
	for _, l := range ls {
		held, err := l.hold(ctx)
		require.NoError(t, err)
		require.Empty(t, held, "%s took lanes before the others could announce themselves", l.id)
		require.True(t, l.waiting)
	}
	seen := map[int32]string{}
	for _, l := range ls {
		// laneWaitCheckEvery later (the test moves the relay's clock
		// instead of sleeping) it takes its share.
		l.checked = l.checked.Add(-laneWaitCheckEvery)
		held, err := l.hold(ctx)
		require.NoError(t, err)
		require.Len(t, held, laneCount/2, "%s's share of two relays", l.id)
		require.False(t, l.waiting)
		for _, lane := range held {
			require.Empty(t, seen[lane], "lane %d held by %s and %s", lane, seen[lane], l.id)
			seen[lane] = l.id
		}
	}
	require.Len(t, seen, laneCount)
}

// meetingPublisher holds its call number hold (1 when 0) until another
// call is in flight (bounded), so a relay that publishes two batches (or
// topics) at once gets through and one that publishes them one after
// another fails the test.
type meetingPublisher struct {
	recorder
	hold     int64
	calls    atomic.Int64
	inFlight atomic.Int64
	most     atomic.Int64
	met      chan struct{}
	once     sync.Once
}

func (p *meetingPublisher) Publish(topic string, msgs ...*message.Message) error {
	n := p.inFlight.Add(1)
	defer p.inFlight.Add(-1)
	for m := p.most.Load(); n > m && !p.most.CompareAndSwap(m, n); m = p.most.Load() {
	}
	if n >= 2 {
		p.once.Do(func() { close(p.met) })
	}
	if p.calls.Add(1) == max(p.hold, 1) {
		select {
		case <-p.met:
		case <-time.After(10 * time.Second):
			return fmt.Errorf("no second call in flight within 10s")
		}
	}
	return p.recorder.Publish(topic, msgs...)
}

// One relay with a backlog publishes its lane groups at once
// (Config.Workers): two publishes are in flight together, every
// event goes out and no aggregate is reordered, also with one hot
// aggregate; with Workers 1 there is one at a time.
func TestRelay_WorkersPublishLaneGroupsAtOnceInOrder(t *testing.T) {
	t.Parallel()
	for _, hot := range []bool{false, true} {
		t.Run(fmt.Sprintf("hot=%t", hot), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const n = 6000
			fillBacklog(t, b, n, 300, hot)
			// Call 2: a relay's first round claims all its lanes in one
			// batch (it has not seen a full one yet); the groups follow.
			pub := &meetingPublisher{hold: 2, met: make(chan struct{})}
			// PublishConcurrency 1: one Publish call per batch and topic.
			startRelay(t, b.db, pub, Config{BatchSize: 100, Workers: 4, PublishConcurrency: 1, PollInterval: 5 * time.Millisecond})
			eventually(t, time.Minute, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
			checkBacklogOrder(t, pub.all(), n)
			require.GreaterOrEqual(t, pub.most.Load(), int64(2), "lane groups were published at once")
		})
	}
	t.Run("Workers=1", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		fillBacklog(t, b, 2000, 300, false)
		pub := &meetingPublisher{met: make(chan struct{})}
		close(pub.met) // nothing to wait for: only the count matters
		startRelay(t, b.db, pub, Config{BatchSize: 100, Workers: 1, PublishConcurrency: 1, PollInterval: 5 * time.Millisecond})
		eventually(t, time.Minute, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
		checkBacklogOrder(t, pub.all(), 2000)
		require.Equal(t, int64(1), pub.most.Load(), "one batch at a time")
	})
}

func TestLaneGroups(t *testing.T) {
	t.Parallel()
	held := []int32{5, 1, 9, 3, 7}
	require.Equal(t, [][]int32{{5, 3}, {1, 7}, {9}}, laneGroups(held, 3))
	require.Equal(t, [][]int32{{5, 1, 9, 3, 7}}, laneGroups(held, 1))
	require.Equal(t, [][]int32{{5}, {1}, {9}, {3}, {7}}, laneGroups(held, 64), "no more groups than lanes")
	require.Equal(t, [][]int32{{5, 1, 9, 3, 7}}, laneGroups(held, 0))
}

// meetingBatch is a batch publisher whose first PublishBatch waits
// (bounded) until a second one is in flight.
type meetingBatch struct {
	meetingPublisher
}

func (p *meetingBatch) PublishBatch(topic string, msgs ...*message.Message) error {
	return p.meetingPublisher.Publish(topic, msgs...)
}

// A batch holding rows of several topics goes out with one PublishBatch
// per topic, the topics at once (one broker round trip, not one per
// topic), each topic's rows in order.
func TestRelay_TopicsOfABatchArePublishedAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var evs []outbox.Event
	for i := range 60 {
		evs = append(evs, outbox.Event{Topic: fmt.Sprintf("topic-%d", i%3), AggregateID: fmt.Sprintf("a%d", i%6), Payload: []byte(fmt.Sprint(i))})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	pub := &meetingBatch{meetingPublisher{met: make(chan struct{})}}
	startRelay(t, b.db, pub, Config{BatchSize: 500, Workers: 1, PollInterval: 5 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
	require.Equal(t, int64(3), pub.calls.Load(), "one PublishBatch per topic, no retry")
	checkBacklogOrder(t, pub.all(), len(evs))
}

// A relay whose last batch was full lends half of its lanes that had rows
// to a spare relay (its busiest lane stays), between rounds; the borrower
// holds them until a round finds nothing in them, then gives them back
// and the owner takes them again. No lane ever has two holders.
func TestLanes_FullRelayLendsToSpareOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	a := &lanes{db: storage.NewSQL(b.db), id: "relay-a", lease: time.Minute, member: true}
	s := &lanes{db: storage.NewSQL(b.db), id: "relay-b", lease: time.Minute, member: true}
	var lent []int32
	a.onLend = func(l []int32) { lent = append(lent, l...) }
	hold := func(l *lanes) []int32 {
		t.Helper()
		l.checked = time.Time{} // the next check is due (instead of sleeping)
		held, err := l.hold(ctx)
		require.NoError(t, err)
		return held
	}
	disjoint := func() {
		t.Helper()
		var owned, distinct int
		require.NoError(t, b.db.QueryRow(`SELECT count(*), count(DISTINCT lane) FROM millwright_outbox_lanes
			WHERE owner IS NOT NULL AND lease_until > now()`).Scan(&owned, &distinct))
		require.Equal(t, owned, distinct)
		require.ElementsMatch(t, append(slices.Clone(a.held), s.held...), ownedLanes(t, b))
	}
	for _, l := range []*lanes{a, s, a, s} { // join, then take the shares
		hold(l)
	}
	require.Len(t, a.held, laneCount/2)
	require.Len(t, s.held, laneCount/2)

	// a's last round: a full batch with rows in 8 of its lanes, the
	// first the busiest; s's: nothing.
	busy := map[int32]int{}
	for i, lane := range a.held[:8] {
		busy[lane] = 10 - i
	}
	a.report(roundResult{n: 500, more: true, perLane: busy})
	s.report(roundResult{})
	hold(s) // s says it is spare
	require.Equal(t, []string{"relay-b"}, s.spares)
	hold(a) // a sees it and lends
	require.Len(t, lent, 4, "half of a's 8 busy lanes")
	require.NotContains(t, lent, a.held[0], "a keeps its busiest lane")
	require.Len(t, a.held, laneCount/2-4)
	for _, lane := range lent {
		require.NotContains(t, a.held, lane)
	}
	// s takes them at its next check, knows them as borrowed, and is no
	// longer spare; a neither waits for them nor takes them back.
	hold(s)
	require.ElementsMatch(t, lent, s.borrowed)
	require.Len(t, s.held, laneCount/2+4)
	require.False(t, s.waiting)
	hold(a)
	require.Len(t, a.held, laneCount/2-4)
	require.False(t, a.waiting, "lanes lent out are not waited for")
	disjoint()
	var load string
	require.NoError(t, b.db.QueryRow(`SELECT load FROM millwright_outbox_relays WHERE id = 'relay-b'`).Scan(&load))
	require.Equal(t, loadSome, load, "a relay with lanes just lent to it is not spare")

	// s's round finds rows in one borrowed lane only: it gives the
	// others back; a takes them again.
	s.report(roundResult{n: 3, perLane: map[int32]int{lent[0]: 3}})
	hold(s)
	require.Equal(t, []int32{lent[0]}, []int32(s.borrowed))
	a.report(roundResult{n: 100, perLane: busy})
	hold(a)
	require.Len(t, a.held, laneCount/2-1)
	disjoint()
	// Then nothing in it either: all back with a.
	s.report(roundResult{})
	hold(s)
	require.Empty(t, s.borrowed)
	hold(a)
	require.Len(t, a.held, laneCount/2)
	require.Len(t, s.held, laneCount/2)
	disjoint()
}

// While the relays, their loads and the lanes stay as they were, a
// running relay's due check is the quick read (storage.QuickLaneCheck) instead of
// a whole one, which would change nothing. A relay joining or leaving, a
// load changing, or a quarter of Lease since the last whole check makes
// the check whole again, and the relays divide the lanes as before.
func TestLanes_QuickCheckWhileNothingChanges(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	a := &lanes{db: storage.NewSQL(b.db), id: "relay-a", lease: time.Minute, member: true, quick: true}
	s := &lanes{db: storage.NewSQL(b.db), id: "relay-b", lease: time.Minute, member: true, quick: true}
	// whole makes l's next check due (instead of sleeping) and reports
	// whether it was a whole one.
	whole := func(l *lanes) bool {
		t.Helper()
		before := l.rebalanced
		l.checked = time.Time{}
		_, err := l.hold(ctx)
		require.NoError(t, err)
		return !l.rebalanced.Equal(before)
	}
	require.True(t, whole(a), "joining")
	require.True(t, whole(a), "taking its share")
	require.Len(t, a.held, laneCount)
	require.False(t, whole(a), "nothing changed")
	require.Len(t, a.held, laneCount)

	a.report(roundResult{n: 500, more: true, perLane: map[int32]int{0: 500}})
	require.True(t, whole(a), "its load changed (full)")
	require.False(t, whole(a))

	require.True(t, whole(s), "s joins")
	require.True(t, whole(a), "a relay joined")
	require.Len(t, a.held, laneCount/2, "a frees s's share")
	require.True(t, whole(s), "s takes its share")
	require.Len(t, s.held, laneCount/2)
	require.False(t, whole(a), "both hold their shares")
	require.ElementsMatch(t, append(slices.Clone(a.held), s.held...), ownedLanes(t, b))

	// s runs out of work: its check is whole (its load changed), and so
	// is a's (s's load changed); then quick, s awaiting a loan, until a
	// lends: s's next check, seeing lanes lent, is whole and takes them.
	s.report(roundResult{})
	require.True(t, whole(s), "s is spare")
	require.True(t, whole(a), "s's load changed")
	require.True(t, s.awaitingLoan())
	require.False(t, whole(s), "s awaits a loan, nothing lent yet")
	a.report(roundResult{n: 500, more: true, perLane: map[int32]int{a.held[0]: 300, a.held[1]: 200}})
	require.True(t, whole(a), "a is full and serves a spare relay: it lends")
	require.Len(t, a.held, laneCount/2-1)
	require.True(t, whole(s), "a lane is lent")
	require.Len(t, s.borrowed, 1)
	s.report(roundResult{})
	require.True(t, whole(s), "s gives it back")
	a.report(roundResult{n: 100, perLane: map[int32]int{a.held[0]: 100}})
	require.True(t, whole(a), "a takes it back")
	require.Len(t, a.held, laneCount/2)

	a.rebalanced = a.rebalanced.Add(-a.lease / 4)
	require.True(t, whole(a), "a quarter of Lease since the last whole check")
	require.False(t, whole(a))

	require.NoError(t, s.free(ctx))
	require.True(t, whole(a), "s left")
	require.Len(t, a.held, laneCount, "a takes s's share")
}

// ownedLanes lists the lanes held under a live lease.
func ownedLanes(t *testing.T, b bundle) []int32 {
	t.Helper()
	return pgtest.Column[int32](t, b.db, `SELECT lane FROM millwright_outbox_lanes WHERE owner IS NOT NULL AND lease_until > now()`)
}

// A backlog all in one relay's share (even lanes only, of two relays)
// is drained by both: the full relay lends lanes to the spare one, each
// aggregate's events still go out in order, and every event goes out.
func TestRelay_SpareRelayDrainsLanesLentToIt(t *testing.T) {
	t.Parallel()
	for _, listen := range []bool{false, true} {
		t.Run(fmt.Sprintf("listen=%v", listen), func(t *testing.T) {
			t.Parallel()
			spareRelayDrainsLanesLentToIt(t, listen)
		})
	}
}

// fillEvenLanes writes n events of topic t over 200 aggregates that hash
// to even lanes only: with two relays, all in one relay's share. Event g
// has payload g.
func fillEvenLanes(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	_, err := db.Exec(`WITH ids AS (
		SELECT array_agg(id) AS a FROM (
			SELECT 'a' || x AS id FROM generate_series(0, 2000) x
			WHERE ((hashtext('acct/a' || x) & 63) % 2) = 0 LIMIT 200) s
	) INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, payload)
	SELECT gen_random_uuid()::text, 't', 'acct', ids.a[1 + g % 200], to_jsonb(g)
	FROM generate_series(0, $1 - 1) g, ids ORDER BY g`, n)
	require.NoError(t, err)
	var oddLanes int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+laneExpr+` % 2 = 1`).Scan(&oddLanes))
	require.Zero(t, oddLanes, "the backlog is in even lanes only")
}

func spareRelayDrainsLanesLentToIt(t *testing.T, listen bool) {
	b := setup(t)
	const events = 20000
	fillEvenLanes(t, b.db, events)

	rec := &recorder{}
	cfg := Config{BatchSize: 200, PollInterval: 5 * time.Millisecond, Lease: 5 * time.Second}
	if listen {
		cfg.ListenURL, cfg.PollInterval = b.schema.URL, time.Second
	}
	pubs := []*countingPublisher{{Publisher: rec}, {Publisher: rec}}
	var relays []*Relay
	for _, p := range pubs {
		relays = append(relays, startRelay(t, b.db, p, cfg))
	}
	eventually(t, 2*time.Minute, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
	checkBacklogOrder(t, rec.all(), events)
	lent := relays[0].lanesLent.Load() + relays[1].lanesLent.Load()
	require.Positive(t, lent, "lanes were lent")
	t.Logf("lanes lent: %d; published by each relay: %d and %d", lent, pubs[0].published.Load(), pubs[1].published.Load())
	for i, p := range pubs {
		require.Greater(t, p.published.Load(), int64(events/10), "relay %d published a real part of the backlog", i)
	}
}

// Within a round the lane groups work on their own: a group whose batch
// is slow to publish does not hold the other back after each batch (it
// used to: the groups met after every batch). The second batch published
// in groups stalls until the other group has published two more; with a
// meeting after every batch they would never come.
func TestRelay_SlowGroupDoesNotHoldTheOtherBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fillBacklog(t, b, 400, 100, false)
	rec := &recorder{}
	r, err := New(postgres.From(b.db), rec, Config{BatchSize: 10, Workers: 2, PollInterval: 5 * time.Millisecond})
	require.NoError(t, err)
	r.groupSpan = time.Minute // the groups meet only when their batches run out
	var batches atomic.Int64
	released := make(chan struct{})
	var stalled, freed atomic.Bool
	r.afterPublish = func(context.Context, []int64) {
		switch batches.Add(1) {
		case 2: // the first round (one batch) ran alone; this is a group's first
			stalled.Store(true)
			select {
			case <-released:
				freed.Store(true)
			case <-time.After(10 * time.Second):
			}
		case 5: // the other group's second and third batches after the stall
			close(released)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	eventually(t, time.Minute, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "drain")
	require.True(t, stalled.Load(), "a batch stalled")
	require.True(t, freed.Load(), "the other group published while one stalled")
	checkBacklogOrder(t, rec.all(), 400)
}
