package storage

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// OutboxWakeLockClass is the first half of the outbox wake-up lock's key
// ("mwox" in ASCII); the second is the outbox table's oid. See
// migrations/002_outbox_wakeup_lock.sql.
const OutboxWakeLockClass = 1836543864

// WakeLock is the outbox's wake-up lock, a session advisory lock an idle
// relay holds on a connection of its own: while a relay holds it, every
// writing transaction notifies at commit. Its statements carry no
// parameters (one round trip with lib/pq).
type WakeLock struct {
	try, unlock, handOver string
}

// Wake-up lock states Try reports.
const (
	WakeLockHeld    = "held"    // this session holds it
	WakeLockOther   = "other"   // another relay holds it
	WakeLockWriters = "writers" // writers hold it shared
)

// NewWakeLock returns the wake-up lock of the outbox table oid, whose
// relays listen on channel. With holdTimeout above 0 (Postgres 14+), a
// session holding the lock sets idle_session_timeout to it, so that a
// holder that stops answering does not keep every writer notifying.
func NewWakeLock(oid uint32, channel string, holdTimeout time.Duration) (WakeLock, error) {
	key := fmt.Sprintf("%d, %d", OutboxWakeLockClass, int32(oid))
	held, unlock := `'held'`, `SELECT pg_advisory_unlock(`+key+`)`
	if holdTimeout > 0 {
		held = `CASE WHEN set_config('idle_session_timeout', '` + strconv.FormatInt(holdTimeout.Milliseconds(), 10) + `', false) IS NOT NULL THEN 'held' END`
		unlock += `, set_config('idle_session_timeout', '0', false)`
	}
	notify, err := inline(S(`, pg_notify($1, '')`, channel), 0)
	if err != nil {
		return WakeLock{}, err
	}
	return WakeLock{
		try: `SELECT CASE
		WHEN pg_try_advisory_lock(` + key + `) THEN ` + held + `
		WHEN EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid = ` + strconv.Itoa(OutboxWakeLockClass) + ` AND objid = '` + strconv.FormatUint(uint64(oid), 10) + `'::oid AND objsubid = 2)
		THEN 'other' ELSE 'writers' END`,
		unlock:   unlock,
		handOver: unlock + notify,
	}, nil
}

// WakeLockTryTimeout bounds Try. The lock's connection sits idle between
// tries; one that went silent meanwhile (a dropped NAT entry, a proxy
// that stopped forwarding: no RST) would otherwise hold the relay in Try
// until TCP gives up (about 15 minutes of retransmissions, or never
// through a proxy), publishing nothing. Past it the statement is
// abandoned and its connection closed (both drivers), and the next Try
// opens another.
const WakeLockTryTimeout = 5 * time.Second

// Try takes the lock without waiting, on q (a pool of one connection: the
// lock is its session's), within WakeLockTryTimeout, and reports
// WakeLockHeld, WakeLockOther or WakeLockWriters.
func (w WakeLock) Try(ctx context.Context, q Querier) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, WakeLockTryTimeout)
	defer cancel()
	var state string
	err := q.QueryRow(ctx, Statement{SQL: w.try, Expect: NoExpect, What: "taking the outbox wake-up lock"}, &state)
	return state, err
}

// Unlock gives the lock back; with handOver it also notifies the channel,
// so that relays sleeping on this one's lock wake and one takes it over.
func (w WakeLock) Unlock(ctx context.Context, q Querier, handOver bool) error {
	s := w.unlock
	if handOver {
		s = w.handOver
	}
	_, err := q.Exec(ctx, Statement{SQL: s, Expect: NoExpect, What: "releasing the outbox wake-up lock"})
	return err
}
