package storage

import (
	"context"
	"database/sql"
	"time"
)

// The relay's lanes (millwright_outbox_lanes, millwright_outbox_relays):
// the statements by which relays divide the outbox's 64 lanes between
// them. See outbox/relay/lanes.go for what each decision means; this file
// holds only the statements.

// OutboxLaneExpr is a row's lane, exactly as
// millwright_outbox_pending_lane_idx indexes it
// (migrations/003_outbox_lanes.sql): a hash of the aggregate, or of the id
// for an event without one.
const OutboxLaneExpr = `(CASE WHEN aggregate_id = '' THEN (id & 63)::int ELSE hashtext(aggregate_type || '/' || aggregate_id) & 63 END)`

// quickLaneCheckSQL is the check a running relay makes instead of
// rebalanceSQL when nothing it knows of has changed: the live relays with
// their loads, as rebalanceSQL's seen column gives them, and whether any
// lane is free, expired or lent. Two small reads that write nothing.
const quickLaneCheckSQL = `SELECT
	(SELECT string_agg(id || ':' || load, ',' ORDER BY id) FROM millwright_outbox_relays WHERE seen_until > now()),
	EXISTS (SELECT 1 FROM millwright_outbox_lanes WHERE owner IS NULL OR lease_until <= now() OR lent)`

// QuickLaneCheck returns the live relays with their loads ("id:load,..."
// in id order, as LaneState.Seen) and whether any lane is free, expired or
// lent.
func QuickLaneCheck(ctx context.Context, q Querier) (seen string, moving bool, err error) {
	var s sql.NullString
	err = q.QueryRow(ctx, Statement{SQL: quickLaneCheckSQL, Expect: NoExpect, What: "the quick lane check"}, &s, &moving)
	return s.String, moving, err
}

// rebalanceSQL, in one statement: renews the relay's membership ($1: id,
// $2: lease in ms, $3: member) and records its load ($5), finds its share
// among the live relays (rank; empty unless $4: take), keeps the lanes
// lent to it except those it gives back ($6, an int[]), frees the lanes
// outside share and loans and takes or renews those inside that are
// free, expired or its own. Leases are renewed once half spent, so most
// checks write nothing: no row lock, no commit to flush. The rare write
// commits without waiting for the WAL flush (a lease a server crash
// forgets is taken again). It returns the lanes the relay holds, how many
// of its share it waits for (those lent to others excluded), how many
// relays are live, the spare and the full ones, its borrowed lanes, and
// how long (ms) the shortest lease of the lanes it holds has left.
//
// A relay holding lanes lent to it that it keeps is not spare, whatever
// its last round found: they were lent after that round.
const rebalanceSQL = `WITH async AS MATERIALIZED (
	SELECT set_config('synchronous_commit', 'off', true)
), borrowed AS (
	SELECT lane FROM millwright_outbox_lanes
	WHERE $3 AND $4 AND owner = $1 AND lent AND lease_until > now() AND lane <> ALL ($6::int[])
), me AS (
	SELECT CASE WHEN $5 = 'spare' AND EXISTS (SELECT 1 FROM borrowed) THEN 'some' ELSE $5 END AS load
), joined AS (
	INSERT INTO millwright_outbox_relays (id, seen_until, load)
	SELECT $1, now() + $2 * interval '1 millisecond', me.load FROM me WHERE $3
	ON CONFLICT (id) DO NOTHING
), renewed AS (
	UPDATE millwright_outbox_relays r SET load = me.load,
		seen_until = CASE WHEN r.seen_until < now() + $2 * interval '0.5 millisecond'
			THEN now() + $2 * interval '1 millisecond' ELSE r.seen_until END
	FROM me
	WHERE $3 AND r.id = $1 AND (r.seen_until < now() + $2 * interval '0.5 millisecond' OR r.load <> me.load)
), gone AS (
	DELETE FROM millwright_outbox_relays WHERE seen_until < now() - interval '1 hour'
), live AS (
	SELECT id, load FROM millwright_outbox_relays WHERE seen_until > now() AND id <> $1
	UNION ALL SELECT $1, me.load FROM me WHERE $3
), share AS (
	SELECT count(*) AS n, count(*) FILTER (WHERE id < $1) AS rank FROM live
), rank AS (
	SELECT l.lane FROM millwright_outbox_lanes l, share s WHERE $4 AND (NOT $3 OR l.lane % s.n = s.rank)
), want AS (
	SELECT lane FROM rank UNION SELECT lane FROM borrowed
), lent_out AS (
	SELECT lane FROM millwright_outbox_lanes
	WHERE lent AND owner <> $1 AND lease_until > now() AND lane IN (SELECT lane FROM rank)
), freed AS (
	UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity', lent = false
	WHERE owner = $1 AND lane NOT IN (SELECT lane FROM want)
), taken AS (
	UPDATE millwright_outbox_lanes l SET owner = $1, lease_until = now() + $2 * interval '1 millisecond',
		lent = l.lane NOT IN (SELECT lane FROM rank)
	WHERE l.lane IN (SELECT lane FROM want)
	  AND (l.owner IS DISTINCT FROM $1 OR l.lease_until < now() + $2 * interval '0.5 millisecond'
		OR (l.lent AND l.lane IN (SELECT lane FROM rank)))
	  AND (l.owner IS NULL OR l.owner = $1 OR l.lease_until <= now())
	RETURNING l.lane
)
SELECT ARRAY(SELECT lane::int8 FROM taken UNION
	SELECT lane FROM millwright_outbox_lanes WHERE owner = $1 AND lease_until >= now() + $2 * interval '0.5 millisecond'
	  AND lane IN (SELECT lane FROM want) ORDER BY 1),
	(SELECT count(*) FROM want) - (SELECT count(*) FROM lent_out),
	(SELECT n FROM share),
	ARRAY(SELECT id FROM live WHERE load = 'spare' ORDER BY id),
	ARRAY(SELECT id FROM live WHERE load = 'full' ORDER BY id),
	ARRAY(SELECT lane::int8 FROM borrowed ORDER BY 1),
	(SELECT string_agg(id || ':' || load, ',' ORDER BY id) FROM live),
	(SELECT extract(epoch FROM LEAST(now() + $2 * interval '1 millisecond', min(lease_until)) - now())::float8 * 1000
		FROM millwright_outbox_lanes WHERE owner = $1 AND lease_until >= now() + $2 * interval '0.5 millisecond'
		  AND lane IN (SELECT lane FROM want) AND lane NOT IN (SELECT lane FROM taken))
FROM async`

// LaneCheck is what a relay asks of CheckLanes.
type LaneCheck struct {
	Relay  string        // the relay's id in millwright_outbox_relays
	Lease  time.Duration // how long its leases last
	Member bool          // a running relay: it renews its membership
	Take   bool          // take its share (false: only announce itself)
	Load   string        // how its last round went: spare, some or full
	// GiveBack are borrowed lanes it gives back.
	GiveBack []int32
}

// LaneState is what CheckLanes found: the lanes the relay holds, how many
// of its share it wants (lent ones excluded), the live relays, the spare
// and the full ones, its borrowed lanes, the live relays with their loads
// ("id:load,..."), and how long the shortest lease it holds has left.
type LaneState struct {
	Held      []int32
	Want      int
	Relays    int
	Spares    []string
	Fulls     []string
	Borrowed  []int32
	Seen      string
	LeaseLeft time.Duration
}

// CheckLanes renews the relay's membership and lanes and divides the lanes
// between the live relays, in one statement (one round trip on both
// drivers).
func CheckLanes(ctx context.Context, q Querier, c LaneCheck) (LaneState, error) {
	var held, borrowed []int64
	var st LaneState
	var seen sql.NullString
	var left sql.NullFloat64 // ms
	s := Statement{SQL: rebalanceSQL, Expect: NoExpect, What: "the lane check",
		Args: []any{c.Relay, c.Lease.Milliseconds(), c.Member, c.Take, c.Load, int64s(c.GiveBack)}}
	if err := q.QueryRow(ctx, s, Array(&held), &st.Want, &st.Relays, Array(&st.Spares), Array(&st.Fulls), Array(&borrowed), &seen, &left); err != nil {
		return LaneState{}, err
	}
	st.Held, st.Borrowed, st.Seen = int32s(held), int32s(borrowed), seen.String
	st.LeaseLeft = time.Duration(left.Float64 * float64(time.Millisecond))
	return st, nil
}

// lendSQL hands lanes $3 (an int[]) of relay $1 to relays $4 (a text[],
// pairwise), each still live and spare, with a fresh lease ($2 ms), and
// marks each taker's load 'some' so that no other relay lends to it before
// it has worked them. It returns the lanes lent.
const lendSQL = `WITH async AS MATERIALIZED (
	SELECT set_config('synchronous_commit', 'off', true)
), given AS (
	UPDATE millwright_outbox_lanes l SET owner = g.relay, lent = true,
		lease_until = now() + $2 * interval '1 millisecond'
	FROM unnest($3::int[], $4::text[]) AS g(lane, relay), millwright_outbox_relays r
	WHERE l.lane = g.lane AND l.owner = $1 AND l.lease_until > now()
	  AND r.id = g.relay AND r.seen_until > now() AND r.load = 'spare'
	RETURNING l.lane, g.relay
), taker AS (
	UPDATE millwright_outbox_relays SET load = 'some' WHERE id IN (SELECT relay FROM given)
)
SELECT ARRAY(SELECT lane::int8 FROM given ORDER BY 1) FROM async`

// LendLanes hands lanes of relay owner to the relays to (pairwise), each
// still live and spare, with a fresh lease, and returns the lanes lent.
func LendLanes(ctx context.Context, q Querier, owner string, lease time.Duration, lanes []int32, to []string) ([]int32, error) {
	var lent []int64
	s := Statement{SQL: lendSQL, Expect: NoExpect, What: "lending lanes",
		Args: []any{owner, lease.Milliseconds(), int64s(lanes), to}}
	if err := q.QueryRow(ctx, s, Array(&lent)); err != nil {
		return nil, err
	}
	return int32s(lent), nil
}

const freeLanesSQL = `WITH freed AS (
	UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity' WHERE owner = $1
) DELETE FROM millwright_outbox_relays WHERE id = $1`

const freeLanesNotifySQL = `WITH freed AS (
	UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity' WHERE owner = $1
), gone AS (
	DELETE FROM millwright_outbox_relays WHERE id = $1
) SELECT pg_notify($2, $3)`

// FreeLanes gives relay owner's lanes back and removes it from the relays'
// table; with channel set it then notifies payload on channel, in the same
// statement.
func FreeLanes(ctx context.Context, q Querier, owner, channel, payload string) error {
	s := Statement{SQL: freeLanesSQL, Args: []any{owner}, Expect: NoExpect, What: "freeing lanes"}
	if channel != "" {
		s.SQL, s.Args = freeLanesNotifySQL, []any{owner, channel, payload}
	}
	_, err := q.Exec(ctx, s)
	return err
}

// Notify sends payload on channel (pg_notify), at once outside a
// transaction.
func Notify(ctx context.Context, q Querier, channel, payload string) error {
	_, err := q.Exec(ctx, Statement{SQL: `SELECT pg_notify($1, $2)`, Args: []any{channel, payload}, Expect: NoExpect, What: "notifying " + channel})
	return err
}

func int64s(v []int32) []int64 {
	out := make([]int64, len(v))
	for i, x := range v {
		out[i] = int64(x)
	}
	return out
}

func int32s(v []int64) []int32 {
	if v == nil {
		return nil
	}
	out := make([]int32, len(v))
	for i, x := range v {
		out[i] = int32(x)
	}
	return out
}
