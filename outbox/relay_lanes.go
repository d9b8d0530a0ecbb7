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

// laneWaitCheckEvery replaces laneCheckEvery while lanes of the relay's
// share are still held by others (a relay that just started, beside one
// that held every lane): it takes each as soon as its holder frees it,
// instead of up to laneCheckEvery later. The holder frees them at its own
// next check, so a new relay starts on its share within about
// laneCheckEvery plus one round of the holder.
const laneWaitCheckEvery = 10 * time.Millisecond

// waitNotifyEvery is how often a relay waiting for lanes of its share wakes
// the other relays (see hold): once when it joins, then again only if a
// holder did not free them, so that lanes held by a relay that died (until
// their leases end) do not wake every relay a hundred times a second.
const waitNotifyEvery = time.Second

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
	notify string        // the outbox's notification channel when relays LISTEN

	held       []int32
	joined     bool      // a running relay announced itself (see hold)
	waiting    bool      // lanes of this relay's share are held by others
	checked    time.Time // last rebalance
	notified   time.Time // last notification that this relay waits for lanes
	validUntil time.Time // the held lanes' leases last at least this long
	rotation   int       // where the next claim starts in held
	relays     int       // live relays at the last rebalance, this one included
}

// hold returns the lanes held, renewing them and looking at the other
// relays when laneCheckEvery (laneWaitCheckEvery while waiting for lanes)
// has passed or the leases near their end.
func (l *lanes) hold(ctx context.Context) ([]int32, error) {
	now := time.Now()
	every := laneCheckEvery
	if l.waiting {
		every = laneWaitCheckEvery
	}
	if l.member && now.Sub(l.checked) < every && now.Before(l.validUntil) {
		return l.order(), nil
	}
	// A running relay's first check only announces it, taking no lane;
	// it takes its share one laneWaitCheckEvery later. Relays started
	// together (a deployment scaled out, a backlog's drain) then see each
	// other before any takes lanes, instead of the first taking all of
	// them and handing most back a round later (Kafka's consumer groups
	// delay their first rebalance for the same reason).
	take := l.joined || !l.member
	if err := l.rebalance(ctx, now, take); err != nil {
		l.held = nil
		return nil, fmt.Errorf("outbox relay: holding lanes (did `millwright migrate` run?): %w", err)
	}
	if !take {
		l.joined, l.waiting = true, true
	}
	if l.waiting && l.notify != "" && now.Sub(l.notified) >= waitNotifyEvery {
		// Relays holding this one's share free it at their next check;
		// one that sleeps until its poll (up to a third of Lease) would
		// keep it that long. Wake them: a relay that wakes checks its
		// lanes first.
		l.notified = now
		if _, err := l.db.ExecContext(ctx, `SELECT pg_notify($1, '')`, l.notify); err != nil {
			return l.order(), fmt.Errorf("outbox relay: waking the relays holding this one's lanes: %w", err)
		}
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
// (want; empty unless $4: take), frees the lanes outside it and takes or
// renews those inside it that are free, expired or its own. Leases are
// renewed once half spent, so most checks write nothing: no row lock, no
// commit to flush. The rare write commits without waiting for the WAL
// flush (a lease a server crash forgets is taken again). It returns the
// lanes the relay holds, how many it wants and how many relays are live.
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
	SELECT l.lane FROM millwright_outbox_lanes l, share s WHERE $4 AND (NOT $3 OR l.lane % s.n = s.rank)
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
func (l *lanes) rebalance(ctx context.Context, start time.Time, take bool) error {
	var held pq.Int32Array
	var want, relays int
	err := l.db.QueryRowContext(ctx, rebalanceSQL, l.id, l.lease.Milliseconds(), l.member, take).Scan(&held, &want, &relays)
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
// table, so that the others take its share at their next check. When
// relays LISTEN it also notifies, once the lanes are free, so that relays
// sleeping until their poll wake and take them at once (a notification
// about an event in one of them would otherwise wake a relay that does
// not hold it yet).
func (l *lanes) free(ctx context.Context) error {
	q := `WITH freed AS (
		UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity' WHERE owner = $1
	) DELETE FROM millwright_outbox_relays WHERE id = $1`
	if l.notify != "" {
		q = `WITH freed AS (
		UPDATE millwright_outbox_lanes SET owner = NULL, lease_until = '-infinity' WHERE owner = $1
	), gone AS (
		DELETE FROM millwright_outbox_relays WHERE id = $1
	) SELECT pg_notify(` + pq.QuoteLiteral(l.notify) + `, '')`
	}
	_, err := l.db.ExecContext(ctx, q, l.id)
	l.held = nil
	if err != nil {
		return fmt.Errorf("outbox relay: freeing lanes (other relays take them when their leases end): %w", err)
	}
	return nil
}
