package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"time"

	"github.com/lib/pq"
)

// laneCount is the number of lanes (see migrations/003_outbox_lanes.sql);
// laneExpr in relay_claim.go and the migration's index hash into it.
const laneCount = 64

// laneCheckEvery is how often a running relay renews its lanes and looks
// whether relays came or went.
const laneCheckEvery = 50 * time.Millisecond

// lanes holds a relay's share of the lanes (millwright_outbox_lanes). A
// relay frees a lane only between rounds, when none of its rows is in
// flight, and another relay takes it only once freed or once its lease
// ran out: one relay at a time publishes a lane, in id order. lanes is not
// safe for concurrent use; the relay's round mutex guards it.
type lanes struct {
	db     *sql.DB
	id     string        // the relay's id in millwright_outbox_relays
	lease  time.Duration // RelayConfig.Lease
	member bool          // a running relay (Run); RunOnce alone takes what is free

	held       []int32
	waiting    bool      // lanes of this relay's share are held by others
	checked    time.Time // last rebalance
	validUntil time.Time // the held lanes' leases last at least this long
	rotation   int       // where the next claim starts in held
	relays     int       // live relays at the last rebalance, this one included
}

// hold returns the lanes held, renewing them and looking at the other
// relays when laneCheckEvery has passed or the leases near their end.
func (l *lanes) hold(ctx context.Context) ([]int32, error) {
	now := time.Now()
	if l.member && now.Sub(l.checked) < laneCheckEvery && now.Before(l.validUntil) {
		return l.order(), nil
	}
	if err := l.rebalance(ctx, now); err != nil {
		l.held = nil
		return nil, fmt.Errorf("outbox relay: holding lanes (did `millwright migrate` run?): %w", err)
	}
	return l.order(), nil
}

// order returns the held lanes starting one further each call, so that a
// claim that fills up from its first lanes favours none of them for long.
func (l *lanes) order() []int32 {
	if len(l.held) == 0 {
		return nil
	}
	l.rotation = (l.rotation + 1) % len(l.held)
	return append(slices.Clone(l.held[l.rotation:]), l.held[:l.rotation]...)
}

// rebalanceSQL, in one statement: renews the relay's membership ($1: id,
// $2: lease in ms, $3: member), finds its share among the live relays
// (want), frees the lanes outside it and takes or renews those inside it
// that are free, expired or its own. Leases are renewed once half spent,
// so most checks write nothing: no row lock, no commit to flush. The rare
// write commits without waiting for the WAL flush (a lease a server crash
// forgets is taken again). It returns the lanes the relay holds, how many
// it wants and how many relays are live.
const rebalanceSQL = `WITH async AS MATERIALIZED (
	SELECT set_config('synchronous_commit', 'off', true)
), joined AS (
	INSERT INTO millwright_outbox_relays (id, seen_until)
	SELECT $1, now() + $2 * interval '1 millisecond' WHERE $3
	ON CONFLICT (id) DO NOTHING
), renewed AS (
	UPDATE millwright_outbox_relays SET seen_until = now() + $2 * interval '1 millisecond'
	WHERE $3 AND id = $1 AND seen_until < now() + $2 * interval '0.5 millisecond'
), gone AS (
	DELETE FROM millwright_outbox_relays WHERE seen_until < now() - interval '1 hour'
), live AS (
	SELECT id FROM millwright_outbox_relays WHERE seen_until > now() AND id <> $1
	UNION ALL SELECT $1 WHERE $3
), share AS (
	SELECT count(*) AS n, count(*) FILTER (WHERE id < $1) AS rank FROM live
), want AS (
	SELECT l.lane FROM millwright_outbox_lanes l, share s WHERE NOT $3 OR l.lane % s.n = s.rank
), freed AS (
	UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity'
	WHERE owner = $1 AND lane NOT IN (SELECT lane FROM want)
), taken AS (
	UPDATE millwright_outbox_lanes l SET owner = $1, lease_until = now() + $2 * interval '1 millisecond'
	WHERE l.lane IN (SELECT lane FROM want)
	  AND (l.owner IS DISTINCT FROM $1 OR l.lease_until < now() + $2 * interval '0.5 millisecond')
	  AND (l.owner IS NULL OR l.owner = $1 OR l.lease_until <= now())
	RETURNING l.lane
)
SELECT ARRAY(SELECT lane FROM taken UNION
	SELECT lane FROM millwright_outbox_lanes WHERE owner = $1 AND lease_until >= now() + $2 * interval '0.5 millisecond'
	  AND lane IN (SELECT lane FROM want) ORDER BY 1),
	(SELECT count(*) FROM want),
	(SELECT n FROM share)
FROM async`

// rebalance runs rebalanceSQL.
func (l *lanes) rebalance(ctx context.Context, start time.Time) error {
	var held pq.Int32Array
	var want, relays int
	err := l.db.QueryRowContext(ctx, rebalanceSQL, l.id, l.lease.Milliseconds(), l.member).Scan(&held, &want, &relays)
	if err != nil {
		return err
	}
	l.held = held
	l.relays = relays
	l.waiting = len(held) < want
	l.checked = start
	// Every lane held has at least half a lease left, counted from before
	// the statement.
	l.validUntil = start.Add(l.lease / 2)
	return nil
}

// free gives the lanes back and, for a running relay, leaves the relays'
// table, so that the others take its share at their next check.
func (l *lanes) free(ctx context.Context) error {
	_, err := l.db.ExecContext(ctx, `WITH freed AS (
		UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity' WHERE owner = $1
	) DELETE FROM millwright_outbox_relays WHERE id = $1`, l.id)
	l.held = nil
	if err != nil {
		return fmt.Errorf("outbox relay: freeing lanes (other relays take them when their leases end): %w", err)
	}
	return nil
}
