package relay

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// requireInOrder checks that got holds, per aggregate, the sequence
// numbers 0, 1, 2, ... once each, and returns the per-aggregate counts.
func requireInOrder(t *testing.T, got *collector) map[string]int {
	t.Helper()
	next := map[string]int{}
	for _, m := range got.all() {
		var p struct {
			Agg string `json:"agg"`
			Seq int    `json:"seq"`
		}
		require.NoError(t, json.Unmarshal(m.Payload, &p))
		require.Equal(t, next[p.Agg], p.Seq, "aggregate %s out of order or repeated", p.Agg)
		next[p.Agg]++
	}
	return next
}

// A retrying row is not passed by the later rows of its aggregate once its
// backoff ends, although the relay went on through its lane meanwhile and
// kept claiming full batches. The backoff ends when the relay has
// published everything else of x's lane and x's later rows are the lane's
// next, while the other lanes keep the batches full: a claim that resumed
// each lane after its last published row (a cursor, as a relay claiming
// its next batch before marking the last would need) would send x's later
// rows first.
func TestRelay_RetryingRowIsNotPassedAfterItsBackoff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	lane := func(agg string) int32 {
		var l int32
		require.NoError(t, b.db.QueryRow(`SELECT hashtext('order/' || $1::text) & 63`, agg).Scan(&l))
		return l
	}
	xLane := lane("x")
	xEvent := func(seq int) outbox.Event {
		return outbox.Event{Topic: "t", AggregateType: "order", AggregateID: "x", Payload: []byte(`{"agg":"x","seq":` + strconv.Itoa(seq) + `}`)}
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), xEvent(0)))
	// Two events for each aggregate of x's lane, thirty for the others.
	var evs []outbox.Event
	var mates int
	for i := range 300 {
		agg := "o" + strconv.Itoa(i)
		n := 30
		if lane(agg) == xLane {
			n, mates = 2, mates+1
		}
		for seq := range n {
			evs = append(evs, outbox.Event{Topic: "t", AggregateType: "order", AggregateID: agg, Payload: []byte(`{"agg":"` + agg + `","seq":` + strconv.Itoa(seq) + `}`)})
		}
	}
	require.Positive(t, mates, "no aggregate shares x's lane: add aggregates")
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	var rest []outbox.Event
	for seq := 1; seq <= 20; seq++ {
		rest = append(rest, xEvent(seq))
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), rest...))
	// x's first event failed once and backs off.
	var first int64
	require.NoError(t, b.db.QueryRow(`UPDATE millwright_outbox SET retry_count = 1, next_attempt_at = now() + interval '1 hour'
		WHERE id = (SELECT min(id) FROM millwright_outbox WHERE aggregate_id = 'x') RETURNING id`).Scan(&first))

	got := b.collect(t, "t")
	startRelay(t, b.db, b.pubsub, Config{BatchSize: 50})
	inLane := laneExpr + ` = ` + strconv.Itoa(int(xLane))
	eventually(t, 60*time.Second, func() bool {
		return count(t, b.db, `status = 'pending' AND aggregate_id <> 'x' AND `+inLane) == 0
	}, "the relay did not publish the rest of x's lane")
	require.Positive(t, count(t, b.db, `status = 'pending' AND NOT (`+inLane+`)`), "the other lanes ran dry first: give them more events")
	_, err := b.db.Exec(`UPDATE millwright_outbox SET next_attempt_at = now() WHERE id = $1`, first)
	require.NoError(t, err)
	eventually(t, 60*time.Second, func() bool { return len(got.all()) >= len(evs)+21 }, "not every event was published")
	counts := requireInOrder(t, got)
	require.Equal(t, 21, counts["x"])
}
