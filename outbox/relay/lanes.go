package relay

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/millwright/millwright/internal/storage"
)

// laneCount is the number of lanes (see migrations/003_outbox_lanes.sql);
// storage.OutboxLaneExpr and the migration's index hash into it.
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

// lanesNotice is the payload of the notifications relays send each other
// about lanes changing hands (writers' notifications have none): a relay
// that receives one checks its lanes before its next claim.
const lanesNotice = "lanes"

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
	db     storage.Querier
	id     string        // the relay's id in millwright_outbox_relays
	lease  time.Duration // Config.Lease
	member bool          // a running relay (Run); RunOnce alone takes what is free
	notify string        // the outbox's notification channel when relays LISTEN

	held       []int32
	joined     bool      // a running relay announced itself (see hold)
	waiting    bool      // lanes of this relay's share are held by others
	checked    time.Time // last rebalance
	notified   time.Time // last notification that this relay waits for lanes
	validUntil time.Time // the held lanes' leases last at least this long
	rotation   int       // where the next claim starts in held
	aside      bool      // the relay stands aside: freed its lanes (see Relay.standAside)
	relays     int       // live relays at the last rebalance, this one included

	// Lending (see "Lending lanes" in DESIGN.md), for a running relay.
	load     string        // how its last round went: loadSpare, loadSome or loadFull
	perLane  map[int32]int // rows per lane its last round claimed; nil when not known
	borrowed []int32       // held lanes of other relays' shares, lent to it
	giveBack []int32       // borrowed lanes its last round found nothing due in
	spares   []string      // live relays whose last round found nothing, at the last check
	fulls    []string      // live relays whose last batch came back full, at the last check
	onLend   func([]int32) // called with the lanes lent at a check

	// The last whole check (rebalance), for unchanged: when, the load it
	// recorded, and the live relays with their loads as it saw them.
	rebalanced time.Time
	sentLoad   string
	relaysSeen string
	quick      bool // make quick checks (storage.QuickLaneCheck); false: every check is whole
}

// A relay's load, as the last round found it (millwright_outbox_relays.load).
const (
	loadSpare = "spare" // nothing was due in its lanes
	loadSome  = "some"
	loadFull  = "full" // its batch came back full: more is due
)

// hold returns the lanes held, renewing them and looking at the other
// relays when laneCheckEvery (laneWaitCheckEvery while waiting for lanes)
// has passed or the leases near their end.
func (l *lanes) hold(ctx context.Context) ([]int32, error) {
	now := time.Now()
	every := laneCheckEvery
	if l.waiting || l.awaitingLoan() {
		every = laneWaitCheckEvery
	}
	// A check is due too once the leases near their end (a tenth of Lease
	// left: the publish bound, see Relay.stages).
	if l.member && now.Sub(l.checked) < every && now.Before(l.validUntil.Add(-l.lease/10)) {
		return l.order(), nil
	}
	if l.unchanged(ctx, now) {
		l.checked = now
		return l.order(), nil
	}
	// A running relay's first check only announces it, taking no lane;
	// it takes its share one laneWaitCheckEvery later. Relays started
	// together (a deployment scaled out, a backlog's drain) then see each
	// other before any takes lanes, instead of the first taking all of
	// them and handing most back a round later (Kafka's consumer groups
	// delay their first rebalance for the same reason).
	take := l.joined || !l.member
	gaveBack := take && len(l.giveBack) > 0 // the check gives them back
	if err := l.rebalance(ctx, now, take); err != nil {
		l.held = nil
		return nil, fmt.Errorf("outbox relay: holding lanes%s: %w", storage.Hint(err), err)
	}
	if !take {
		l.joined, l.waiting = true, true
	}
	if err := l.wakeOthers(ctx, now, gaveBack); err != nil {
		return l.order(), err
	}
	if err := l.lendToSpares(ctx); err != nil {
		// The statement may have committed: hold nothing until the next
		// check says what this relay holds.
		l.held, l.validUntil = nil, time.Time{}
		return nil, err
	}
	return l.order(), nil
}

// unchanged reports whether a whole check (storage.CheckLanes) due now
// would change nothing, from a quicker read (storage.QuickLaneCheck): the
// live relays with their loads, and whether any lane is free, expired or
// lent. The relay is
// running, holds its share (waits for no lane, gives none back, lends
// none), its load is the one it recorded, its last whole check is less
// than a quarter of Lease old (so its leases, renewed once half spent,
// keep at least a quarter), the same relays are live with the same loads,
// and no lane is free, expired or lent. Then the whole check would take,
// free, renew and lend nothing, and the relay's share, computed from the
// live relays, is the same (a spare relay awaiting a loan sees lanes lent
// to it as lent, and makes the whole check that takes them). A relay busy
// with a backlog so makes a whole check about every Lease/4 instead of
// every laneCheckEvery (what that saves: DESIGN.md, "Lanes"). Any error
// makes the check whole.
func (l *lanes) unchanged(ctx context.Context, now time.Time) bool {
	if !l.quickMay(now) {
		return false
	}
	seen, moving, err := storage.QuickLaneCheck(ctx, l.db)
	if err != nil {
		return false
	}
	return !moving && seen == l.relaysSeen
}

// quickMay reports whether, as far as the relay itself knows, its whole
// check due now would change nothing (see unchanged).
func (l *lanes) quickMay(now time.Time) bool {
	load := l.load
	if load == "" {
		load = loadSome
	}
	switch {
	case !l.quick || !l.member || !l.joined || l.rebalanced.IsZero():
		return false // not running, or no whole check to compare with
	case l.waiting || len(l.giveBack) > 0 || (load == loadFull && len(l.takers()) > 0):
		return false // it takes, gives back or lends lanes
	case load != l.sentLoad:
		return false // its load is to be recorded
	}
	// More than half a lease left: a batch's publish, bounded by the end of
	// the leases (see Config.Lease), gets that much. Else the whole
	// check renews them.
	return now.Sub(l.rebalanced) < l.lease/4 && l.validUntil.Sub(now) > l.lease/2
}

// wakeOthers notifies, when relays LISTEN, after a check that needs other
// relays to check theirs now rather than when they wake: this relay waits
// for lanes of its share (relays holding them free them at their next
// check, and one sleeping until its poll, up to a third of Lease, would
// keep them that long), or it gave borrowed lanes back (their owners take
// them at their next check). A relay woken checks its lanes first.
func (l *lanes) wakeOthers(ctx context.Context, now time.Time, gaveBack bool) error {
	wait := l.waiting && now.Sub(l.notified) >= waitNotifyEvery
	if l.notify == "" || (!wait && !gaveBack) {
		return nil
	}
	if wait {
		l.notified = now
	}
	if err := storage.Notify(ctx, l.db, l.notify, lanesNotice); err != nil {
		return fmt.Errorf("outbox relay: waking the other relays to check their lanes: %w", err)
	}
	return nil
}

// awaitingLoan reports whether the relay had nothing to do while other
// relays had full batches: it then checks its lanes as often as while
// waiting for its share, so that it starts on lanes lent to it at once.
func (l *lanes) awaitingLoan() bool {
	return l.member && l.load == loadSpare && len(l.fulls) > 0
}

// report records how a round on the held lanes went: its load, for the
// next check, and which borrowed lanes to give back. perLane is nil when
// the round does not know its rows' lanes (a round that claimed nothing);
// a borrowed lane is then given back once a round found nothing at all.
func (l *lanes) report(res roundResult) {
	if !l.member {
		return
	}
	switch {
	case res.err != nil:
		l.load = loadSome // a failing relay neither lends nor borrows
	case res.n == 0 && (l.waiting || len(l.held) == 0):
		// Joining, or waiting for its share: not out of work.
		l.load = loadSome
	case res.n == 0:
		l.load = loadSpare
	case res.more && res.perLane != nil:
		// Lending needs the rows per lane.
		l.load = loadFull
	default:
		l.load = loadSome
	}
	l.perLane = res.perLane
	l.giveBack = l.giveBack[:0]
	if res.err != nil || res.more {
		return // a full batch may have left out some lanes' rows
	}
	for _, lane := range l.borrowed {
		if res.n == 0 || (res.perLane != nil && res.perLane[lane] == 0) {
			l.giveBack = append(l.giveBack, lane)
		}
	}
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

// rebalance makes the whole check (storage.CheckLanes, one statement):
// renews the relay's membership and records its load, finds its share
// among the live relays (none unless take), keeps the lanes lent to it
// except those it gives back, frees the lanes outside share and loans and
// takes or renews those inside that are free, expired or its own.
func (l *lanes) rebalance(ctx context.Context, start time.Time, take bool) error {
	load := l.load
	if load == "" {
		load = loadSome
	}
	l.rebalanced = time.Time{}
	st, err := storage.CheckLanes(ctx, l.db, storage.LaneCheck{Relay: l.id, Lease: l.lease, Member: l.member, Take: take, Load: load, GiveBack: l.giveBack})
	if err != nil {
		return err
	}
	held, want, relays, spares, fulls, borrowed, seen := st.Held, st.Want, st.Relays, st.Spares, st.Fulls, st.Borrowed, st.Seen
	l.rebalanced, l.sentLoad, l.relaysSeen = start, load, seen
	l.held = held
	l.relays = relays
	l.waiting = len(held) < want
	l.checked = start
	l.spares, l.fulls, l.borrowed = spares, fulls, borrowed
	l.giveBack = l.giveBack[:0]
	// Every lane held has at least half a lease left (leases are renewed
	// once half spent), left exactly, counted from before the statement:
	// an end no later than the leases' (durations only, so the relay's and
	// the server's clocks need not agree).
	l.validUntil = start.Add(max(st.LeaseLeft, l.lease/2))
	return nil
}

// lendToSpares, at a check of a relay whose last batch came back full,
// lends some of its lanes that had rows to the spare relays paired with
// it: full relay j of F (by id) serves spare relays j, j+F, ...; with m of
// them, it keeps its busiest lane and every (m+1)-th after it and lends
// the others in turn. Between rounds, so nothing of them is in flight.
func (l *lanes) lendToSpares(ctx context.Context) error {
	if l.load != loadFull || l.perLane == nil {
		return nil
	}
	takers := l.takers()
	if len(takers) == 0 {
		return nil
	}
	busy := make([]int32, 0, len(l.held))
	for _, lane := range l.held {
		if l.perLane[lane] > 0 {
			busy = append(busy, lane)
		}
	}
	slices.SortFunc(busy, func(a, b int32) int {
		if c := l.perLane[b] - l.perLane[a]; c != 0 {
			return c
		}
		return int(a - b)
	})
	var give []int32
	var to []string
	for i, lane := range busy {
		if k := i % (len(takers) + 1); k > 0 {
			give = append(give, lane)
			to = append(to, takers[k-1])
		}
	}
	if len(give) == 0 {
		return nil
	}
	lent, err := storage.LendLanes(ctx, l.db, l.id, l.lease, give, to)
	if err != nil {
		return fmt.Errorf("outbox relay: lending lanes to spare relays: %w", err)
	}
	if len(lent) == 0 {
		return nil
	}
	l.held = slices.DeleteFunc(l.held, func(lane int32) bool { return slices.Contains(lent, lane) })
	l.spares = nil // each served once per check
	if l.onLend != nil {
		l.onLend(lent)
	}
	return nil
}

// takers are the spare relays a running full relay serves (full relay j
// of F serves spare relays j, j+F, ...), as of the last check.
func (l *lanes) takers() []string {
	j := slices.Index(l.fulls, l.id)
	if !l.member || j < 0 {
		return nil
	}
	var takers []string
	for i := j; i < len(l.spares); i += len(l.fulls) {
		takers = append(takers, l.spares[i])
	}
	return takers
}

// free gives the lanes back and, for a running relay, leaves the relays'
// table, so that the others take its share at their next check. When
// relays LISTEN it also notifies, once the lanes are free, so that relays
// sleeping until their poll wake and take them at once (a notification
// about an event in one of them would otherwise wake a relay that does
// not hold it yet).
func (l *lanes) free(ctx context.Context) error {
	err := storage.FreeLanes(ctx, l.db, l.id, l.notify, lanesNotice)
	l.held = nil
	if err != nil {
		return fmt.Errorf("outbox relay: freeing lanes (other relays take them when their leases end): %w", err)
	}
	return nil
}
