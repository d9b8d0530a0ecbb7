package relay

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// The claim's lane expression is the index's: written twice (Go and the
// migration), a difference would turn every claim into a scan of the
// backlog.
func TestClaim_UsesTheLaneIndex(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for range 3 {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}, outbox.Event{Topic: "t", AggregateID: "b"}, outbox.Event{Topic: "t"}))
	}
	plan := pgtest.Plan(t, b.db, strings.NewReplacer("$1", "'{1,2,3}'", "$2", "500", "$3", "'{167,167,167}'").Replace(claimSQL))
	// The partitioned layout's partitions name their copy of the index
	// after the expression (see migrations_partitioned).
	require.True(t, strings.Contains(plan, "millwright_outbox_pending_lane_idx") || strings.Contains(plan, "_case_id_idx"), "the claim reads the lane index:\n%s", plan)
}

// Every event of an aggregate hashes to one lane, and the lanes spread.
func TestClaim_LanesSpreadAggregates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var evs []outbox.Event
	for i := range 1000 {
		evs = append(evs, outbox.Event{Topic: "t", AggregateType: "order", AggregateID: string(rune('a'+i%26)) + string(rune('a'+i/26%26))})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	var perAggregate, lanesUsed int
	require.NoError(t, b.db.QueryRow(`SELECT max(n), (SELECT count(DISTINCT `+laneExpr+`) FROM millwright_outbox)
		FROM (SELECT count(DISTINCT `+laneExpr+`) n FROM millwright_outbox GROUP BY aggregate_type, aggregate_id) x`).Scan(&perAggregate, &lanesUsed))
	require.Equal(t, 1, perAggregate)
	require.Equal(t, laneCount, lanesUsed)
}

// A batch takes a share of every busy lane before it fills up from the
// lanes' next rows, and each lane's rows in it are the lane's first in id
// order; with one busy lane the fill keeps the batch full.
func TestClaim_SpreadsTheBatchOverTheLanes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var evs []outbox.Event
	for range 100 {
		evs = append(evs, outbox.Event{Topic: "t", AggregateType: "order", AggregateID: "hot"})
	}
	for i := range 20 {
		for range 3 {
			evs = append(evs, outbox.Event{Topic: "t", AggregateType: "order", AggregateID: "cold-" + strconv.Itoa(i)})
		}
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	r, err := New(postgres.From(b.db), b.pubsub, Config{BatchSize: 40})
	require.NoError(t, err)
	all := allLanes()
	// pending[lane] is the lane's pending ids in id order.
	pending := func() map[int][]int64 {
		rows, err := b.db.QueryContext(ctx, `SELECT `+laneExpr+`, id FROM millwright_outbox WHERE status = 'pending' ORDER BY id`)
		require.NoError(t, err)
		defer rows.Close()
		m := map[int][]int64{}
		for rows.Next() {
			var lane int
			var id int64
			require.NoError(t, rows.Scan(&lane, &id))
			m[lane] = append(m[lane], id)
		}
		require.NoError(t, rows.Err())
		return m
	}
	// claimed returns the claim's ids by lane, checking each lane's are a
	// prefix of its pending ids.
	claimed := func(lanes map[int][]int64) map[int][]int64 {
		got, err := r.claim(ctx, all)
		require.NoError(t, err)
		require.Len(t, got, 40, "the batch is full")
		laneOf := map[int64]int{}
		for l, ids := range lanes {
			for _, id := range ids {
				laneOf[id] = l
			}
		}
		m := map[int][]int64{}
		for _, rw := range got {
			l, ok := laneOf[rw.id]
			require.True(t, ok, "claimed id %d is pending", rw.id)
			m[l] = append(m[l], rw.id)
		}
		for l, ids := range m {
			require.Equal(t, lanes[l][:len(ids)], ids, "lane %d: its first rows in id order", l)
		}
		return m
	}
	lanes := pending()
	require.Greater(t, len(lanes), 2, "the aggregates use several lanes")
	got := claimed(lanes)
	require.Len(t, got, len(lanes), "every busy lane has rows in the batch")

	_, err = b.db.ExecContext(ctx, `DELETE FROM millwright_outbox WHERE aggregate_id <> 'hot'`)
	require.NoError(t, err)
	lanes = pending()
	require.Len(t, lanes, 1)
	got = claimed(lanes)
	require.Len(t, got, 1)
}

// On database/sql the claim is one simple query (its arguments inlined by
// the storage layer): it leaves no prepared statement on the pool's
// sessions, where one stayed until the *sql.DB closed unless Close
// closed it; and a relay works again after Close.
func TestClaim_LeavesNoPreparedStatement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.db.SetMaxOpenConns(1) // one session: the one pg_prepared_statements shows
	prepared := func() int {
		t.Helper()
		var n int
		require.NoError(t, b.db.QueryRowContext(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%CROSS JOIN LATERAL%'`).Scan(&n))
		return n
	}
	r, err := New(postgres.From(b.db), b.pubsub, Config{})
	require.NoError(t, err)
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, prepared(), "nothing prepared on the session")
	require.NoError(t, r.Close())
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	n, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "RunOnce after Close")
	require.NoError(t, r.Close())
}

// A lane's share of a batch follows how densely its due rows lie in the
// ids, learnt from its last batch: a lane with a row at every id gets
// about eight times the share of one with a row at every eighth; a lane
// that gave less than its share in a batch that was not full (dry) gets
// the least share, and a lane not seen yet the mean of the known ones.
func TestLaneRates_SharesFollowTheLanesDensity(t *testing.T) {
	var lr laneRates
	held := []int32{3, 5, 7, 9}
	require.Equal(t, []int32{25, 25, 25, 25}, lr.shares(100, held), "nothing learnt: equal shares")

	var rows []row
	for i := range 25 {
		rows = append(rows, row{lane: 3, id: int64(1000 + i)})   // dense
		rows = append(rows, row{lane: 5, id: int64(1000 + 8*i)}) // sparse
	}
	rows = append(rows, row{lane: 7, id: 5})           // 1 of its 25: dry
	lr.learn(100, held[:3], []int32{25, 25, 25}, rows) // lane 9 not in that batch
	got := lr.shares(100, held)
	least := int32(25 / 4)
	require.Equal(t, least, got[2], "a dry lane gets the least share")
	require.InDelta(t, 8, float64(got[0])/float64(got[1]), 0.5, "shares in proportion to density: %v", got)
	mean := (1.0 + 1.0/8) / 2
	require.InDelta(t, mean/1.0, float64(got[3])/float64(got[0]), 0.05, "an unknown lane gets the mean: %v", got)
	var sum int32
	for i, s := range got {
		if i != 2 {
			sum += s
		}
	}
	require.InDelta(t, 100, sum, 4, "the lanes not dry share about the batch: %v", got)

	// A full batch within its first pass (no lane beyond its share) that
	// gave a lane less than its share says nothing of it: the batch's
	// LIMIT may have cut it. Lane 9 stays unknown, its density learnt
	// from its rows; a fill row (lane 3 beyond its share) shows that the
	// first pass was whole, and lane 9 is then dry.
	lr.learn(4, []int32{9, 3}, []int32{25, 2}, []row{{lane: 9, id: 1}, {lane: 9, id: 9}, {lane: 3, id: 2}, {lane: 3, id: 3}})
	require.InDelta(t, 1.0/8, lr.density[9], 1e-9, "learnt from its rows")
	lr.learn(4, []int32{9, 3}, []int32{25, 1}, []row{{lane: 9, id: 1}, {lane: 9, id: 9}, {lane: 3, id: 2}, {lane: 3, id: 3}})
	require.Less(t, lr.density[9], 0.0, "less than its share in a whole first pass: dry")
}

// With one aggregate holding most of the backlog, the relay's second
// batch takes more of the hot lane than an equal share, and still only
// each lane's first due rows in id order.
func TestClaim_HotLaneGetsTheLargerShare(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var evs []outbox.Event
	for i := range 800 {
		agg := "hot" // every other event
		if i%2 == 1 {
			agg = "cold-" + strconv.Itoa(i%50)
		}
		evs = append(evs, outbox.Event{Topic: "t", AggregateType: "order", AggregateID: agg})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	var hotLane int32
	require.NoError(t, b.db.QueryRow(`SELECT `+laneExpr+` FROM millwright_outbox WHERE aggregate_id = 'hot' LIMIT 1`).Scan(&hotLane))
	r, err := New(postgres.From(b.db), b.pubsub, Config{BatchSize: 100})
	require.NoError(t, err)
	all := allLanes()
	count := func() (hot int, lanes int) {
		got, err := r.claim(ctx, all)
		require.NoError(t, err)
		require.Len(t, got, 100)
		seen := map[int32]bool{}
		var ids []int64
		for _, rw := range got {
			seen[rw.lane] = true
			if rw.lane == hotLane {
				hot++
				ids = append(ids, rw.id)
			}
		}
		want := pgtest.Column[int64](t, b.db, `SELECT id FROM millwright_outbox WHERE status = 'pending' AND `+laneExpr+` = $1 ORDER BY id LIMIT $2`, hotLane, len(ids))
		require.Equal(t, want, ids, "the hot lane's first rows in id order")
		return hot, len(seen)
	}
	first, lanes := count()
	// First batch: 2 rows of each lane, then the fill from the lanes' next
	// rows, lane after lane.
	require.Greater(t, lanes, 20, "the cold aggregates use many lanes")
	second, _ := count() // nothing marked: the same rows, shared by density
	t.Logf("hot lane: %d rows of the first batch, %d of the second", first, second)
	// Half the rows are the hot aggregate's: an equal share is 2 rows,
	// its share by density is most of the batch (the cold lanes' least
	// shares take the rest).
	require.GreaterOrEqual(t, second, 25, "the hot lane's share follows its density")
	require.Greater(t, second, first)
}

// allLanes lists every lane.
func allLanes() []int32 {
	all := make([]int32, laneCount)
	for i := range all {
		all[i] = int32(i)
	}
	return all
}
