package outbox

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
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
	conn, err := b.db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `SET enable_seqscan = off`)
	require.NoError(t, err)
	rows, err := conn.QueryContext(ctx, `EXPLAIN `+strings.NewReplacer("$1", "'{1,2,3}'", "$2", "500").Replace(claimSQL))
	require.NoError(t, err)
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	require.Contains(t, strings.Join(plan, "\n"), "millwright_outbox_pending_lane_idx")
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
