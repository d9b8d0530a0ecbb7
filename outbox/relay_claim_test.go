package outbox

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
)

// The claim's lane expression is the index's: written twice (Go and the
// migration), a difference would turn every claim into a scan of the
// backlog.
func TestClaim_UsesTheLaneIndex(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for range 3 {
		require.NoError(t, Add(ctx, b.db, Event{Topic: "t", AggregateID: "a"}, Event{Topic: "t", AggregateID: "b"}, Event{Topic: "t"}))
	}
	plan := pgtest.Plan(t, b.db, strings.NewReplacer("$1", "'{1,2,3}'", "$2", "500", "$3", "167").Replace(claimSQL))
	// The partitioned layout's partitions name their copy of the index
	// after the expression (see migrations_partitioned).
	require.True(t, strings.Contains(plan, "millwright_outbox_pending_lane_idx") || strings.Contains(plan, "_case_id_idx"), "the claim reads the lane index:\n%s", plan)
}

// Every event of an aggregate hashes to one lane, and the lanes spread.
func TestClaim_LanesSpreadAggregates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var evs []Event
	for i := range 1000 {
		evs = append(evs, Event{Topic: "t", AggregateType: "order", AggregateID: string(rune('a'+i%26)) + string(rune('a'+i/26%26))})
	}
	require.NoError(t, Add(ctx, b.db, evs...))
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
	var evs []Event
	for range 100 {
		evs = append(evs, Event{Topic: "t", AggregateType: "order", AggregateID: "hot"})
	}
	for i := range 20 {
		for range 3 {
			evs = append(evs, Event{Topic: "t", AggregateType: "order", AggregateID: "cold-" + strconv.Itoa(i)})
		}
	}
	require.NoError(t, Add(ctx, b.db, evs...))
	r, err := NewRelay(b.db, b.pubsub, RelayConfig{BatchSize: 40})
	require.NoError(t, err)
	all := make([]int32, laneCount)
	for i := range all {
		all[i] = int32(i)
	}
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

// Close closes the relay's prepared claim on the pool's connections (it
// stayed prepared there until the *sql.DB closed), and a RunOnce after
// Close prepares it again.
func TestClaim_CloseClosesThePreparedClaim(t *testing.T) {
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
	r, err := NewRelay(b.db, b.pubsub, RelayConfig{})
	require.NoError(t, err)
	require.NoError(t, Add(ctx, b.db, Event{Topic: "t", AggregateID: "a"}))
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, prepared(), "the claim is prepared on the session")
	require.NoError(t, r.Close())
	require.Zero(t, prepared(), "Close closed it")
	require.NoError(t, Add(ctx, b.db, Event{Topic: "t", AggregateID: "a"}))
	n, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "RunOnce after Close prepares the claim again")
	require.NoError(t, r.Close())
	require.Zero(t, prepared())
}
