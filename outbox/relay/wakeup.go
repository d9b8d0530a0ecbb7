package relay

import (
	"context"
	"crypto/md5" //nolint:gosec // a name, not a secret: Postgres has md5 built in
	"encoding/hex"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/retry"
)

// idleRecheck is how soon an idle relay looks again when a writer that may
// have missed its request for a notification is still in its transaction.
const idleRecheck = 5 * time.Millisecond

// announceIdle asks writers for a NOTIFY by taking the wake-up lock on the
// relay's own connection, without waiting. While a relay holds it, every
// writing transaction notifies at commit. It reports settled when no
// writer that committed unannounced can be in flight: true once the lock
// is held (every writer that took it shared has ended, so a look at the
// table now sees its rows) or when another relay holds it (writers notify
// it, and every relay LISTENs); false while writers hold it shared, so the
// relay must look again soon.
//
// release gives the lock back; call it as soon as the relay has work, and
// when it wakes. With handOver (the relay is stopping) it also notifies,
// so that relays sleeping on this one's lock wake and one of them takes it
// over; without it they would sleep until their poll. release is
// idempotent.
func (r *Relay) announceIdle(ctx context.Context) (release func(handOver bool), settled bool, err error) {
	release = func(bool) {}
	state, err := r.wakeLock.Try(ctx, r.waitDB)
	if err != nil {
		return release, false, fmt.Errorf("taking the outbox wake-up lock: %w", err)
	}
	switch state {
	case storage.WakeLockHeld:
		done := false
		return func(handOver bool) {
			if done {
				return
			}
			done = true
			// A failed unlock leaves the lock to the session's end:
			// writers notify a little longer, nothing is lost. Bounded,
			// so an unreachable server cannot stall the relay here.
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := r.wakeLock.Unlock(uctx, r.waitDB, handOver); err != nil {
				r.cfg.Logger.Info("outbox relay: releasing the wake-up lock failed; the connection's end releases it", watermill.LogFields{"err": err.Error()})
			}
		}, true, nil
	case storage.WakeLockOther:
		return release, true, nil
	default:
		return release, false, nil
	}
}

// holdTimeout is the idle_session_timeout of a session holding the wake-up
// lock: well beyond the longest a live relay leaves it idle (PollInterval).
func (r *Relay) holdTimeout() time.Duration { return 3*r.cfg.PollInterval + 2*time.Second }

// listen starts a LISTEN on the outbox's notification channel and forwards
// notifications (and reconnections, after which some may have been missed)
// to wake. It also opens the connection on which the idle relay holds the
// wake-up lock (announceIdle): both are on ListenURL, outside the caller's
// pool, so a small pool cannot starve them, and of the pool's driver (pgx
// listens with WaitForNotification, database/sql with lib/pq's Listener).
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) (stop func(), err error) {
	t, err := storage.FindOutboxTable(ctx, r.db)
	if err != nil {
		return nil, fmt.Errorf("finding the schema of millwright_outbox%s: %w", storage.Hint(err), err)
	}
	if t.Channel != NotifyChannel(t.Schema) {
		// The trigger would notify a channel this relay does not listen
		// on: it would sleep until its poll after every write.
		return nil, fmt.Errorf("schema %q: the server names its wake-up channel %q, the relay %q (a long non-ASCII schema name in a database whose encoding is not UTF8): use a schema name of ASCII letters, digits and _", t.Schema, t.Channel, NotifyChannel(t.Schema))
	}
	waitDB, closeWait, err := r.openWaitDB(ctx, t)
	if err != nil {
		return nil, err
	}
	l, err := storage.NewListener(ctx, r.db.Driver(), storage.ListenerConfig{URL: r.cfg.ListenURL,
		MinReconnect: 100 * time.Millisecond, MaxReconnect: 10 * time.Second,
		OnEvent: func(ev string, err error) {
			r.cfg.Logger.Info("outbox relay: listener event", watermill.LogFields{"event": ev, "err": err.Error()})
		}})
	if err == nil {
		// Listen waits for a connection until ctx ends.
		if err = l.Listen(ctx, NotifyChannel(t.Schema)); err != nil {
			_ = l.Close()
		}
	}
	if err != nil {
		closeWait()
		return nil, fmt.Errorf("LISTEN %q: %w", NotifyChannel(t.Schema), err)
	}
	hold := time.Duration(0)
	if t.Version >= 140000 {
		hold = r.holdTimeout()
	}
	if r.wakeLock, err = storage.NewWakeLock(t.OID, NotifyChannel(t.Schema), hold); err != nil {
		_ = l.Close()
		closeWait()
		return nil, err
	}
	r.schema, r.tableOID, r.waitDB, r.holdGuard = t.Schema, t.OID, waitDB, hold > 0
	done := make(chan struct{})
	go r.forwardNotifications(ctx, l, wake, done)
	return func() {
		_ = l.Close()
		<-done
		closeWait()
	}, nil
}

// openWaitDB opens the connection of the wake-up lock on ListenURL and
// checks that it reaches the outbox table t. Bounded (see
// internal/pgconn): connect_timeout unless ListenURL sets one, and each
// call gives up when its ctx ends, even on a server that accepts and
// never answers.
func (r *Relay) openWaitDB(ctx context.Context, t storage.OutboxTable) (storage.Pool, func(), error) {
	waitDB, closeWait, err := storage.OpenSession(ctx, r.db.Driver(), r.cfg.ListenURL)
	if err != nil {
		return nil, nil, fmt.Errorf("relay.Config.ListenURL: %w", err)
	}
	lt, err := storage.FindOutboxTable(ctx, waitDB)
	if err != nil {
		closeWait()
		return nil, nil, fmt.Errorf("relay.Config.ListenURL does not reach millwright_outbox (it must reach the relay's database and search_path): %w", err)
	}
	if lt.OID != t.OID {
		closeWait()
		return nil, nil, fmt.Errorf("relay.Config.ListenURL reaches millwright_outbox in %s.%s, the relay's pool the one in %s.%s: point both at the same database and search_path", lt.Database, lt.Schema, t.Database, t.Schema)
	}
	return waitDB, closeWait, nil
}

// forwardNotifications wakes the relay at each notification of l until ctx
// ends or l closes, then closes done. A lanes notice, or a reconnection
// (nil: one may have been missed), makes the next round check the lanes.
func (r *Relay) forwardNotifications(ctx context.Context, l storage.Listener, wake chan<- struct{}, done chan<- struct{}) {
	defer close(done)
	for {
		select {
		case <-ctx.Done():
			return
		case n, ok := <-l.Notifications():
			if !ok {
				return
			}
			if n == nil || n.Payload == lanesNotice {
				r.lanesChanged.Store(true)
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}
}

// NotifyChannel is the LISTEN channel of the outbox table in schema:
// "millwright_outbox:" + schema for a schema of at most 45 bytes (the name
// of every version before), and "millwright_outbox#" + the hex MD5 of the
// schema for a longer one, so that the channel stays within Postgres' 63
// bytes for any schema name. The trigger and RetryFailed compute the same
// name in SQL (storage.OutboxNotifyChannelSQL); the two agree in a UTF-8 database (in
// another encoding a non-ASCII schema's bytes differ, and the relay, which
// checks, polls instead of listening).
func NotifyChannel(schema string) string {
	if len(schema) <= storage.OutboxMaxPlainSchemaBytes {
		return storage.OutboxNotifyPrefix + schema
	}
	sum := md5.Sum([]byte(schema))
	return storage.OutboxNotifyHashPrefix + hex.EncodeToString(sum[:])
}

func (r *Relay) refreshLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.MetricsInterval)
	defer t.Stop()
	for {
		if err := r.m.refreshGauges(ctx, r.db); err != nil && ctx.Err() == nil {
			r.cfg.Logger.Error("outbox relay: refreshing backlog gauges", err, nil)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// The relay's own failures (its database unreachable, the lane check, the
// claim or the marks failing, a batch cut at its bound, standing aside)
// are retried after failureBackoff's delays, not the row retry policy
// (Config.Retry: a row's backoff, minutes long, with a budget): a
// failing relay must come back within about a second of its database
// answering again, and needs no budget (it retries until it works).
const (
	// failureInitial is the backoff after the first failure: equal
	// jitter draws the first wait from [50ms, 100ms], so a blip costs
	// little.
	failureInitial = 100 * time.Millisecond
	// failureMax caps the backoff (the waits are drawn from [0.5s, 1s]
	// once it is reached): a relay retries at most about every half
	// second while its database is down, and is back within a second of
	// its answering.
	failureMax = time.Second
	// failureLogEvery is how often a relay that keeps failing logs: the
	// first failure, then one line per failureLogEvery with the count of
	// the failures since, then one line when it recovers.
	failureLogEvery = 10 * time.Second
)

// failureBackoff is the retry policy of the relay's own failures: doubling
// from failureInitial to failureMax (or a third of the lease, if that is
// shorter, so that a relay whose claim failed still renews its lanes in
// time), equal jitter (never much shorter than the schedule, so that the
// number of attempts of an outage stays bounded, still spread so that
// relays restarted together do not retry together), no limit.
func failureBackoff(lease time.Duration) retry.Policy {
	maxWait := min(failureMax, max(lease/3, laneCheckEvery))
	return retry.Policy{InitialInterval: min(failureInitial, maxWait), Multiplier: 2, MaxInterval: maxWait,
		MaxAttempts: -1, Jitter: retry.JitterEqual}.WithDefaults()
}

// failures paces and logs a run of consecutive failures of one thing the
// relay does: each failure gets the next backoff of policy, and is logged
// only if it is the first of the run or failureLogEvery has passed since
// the last line (which then counts the failures since); the success that
// ends the run logs once. Only Run's goroutine uses it.
type failures struct {
	policy retry.Policy
	every  time.Duration
	log    watermill.LoggerAdapter
	now    func() time.Time // time.Now; tests set a clock

	n        int       // consecutive failures
	first    time.Time // of the run
	logged   time.Time // last line
	unlogged int       // failures since the last line
	prev     time.Duration
}

func newFailures(log watermill.LoggerAdapter, lease time.Duration) *failures {
	return &failures{policy: failureBackoff(lease), every: failureLogEvery, log: log, now: time.Now}
}

// failed records a failure of what (e.g. "outbox relay: batch failed")
// and returns how long to wait before trying again.
func (f *failures) failed(what string, err error) time.Duration {
	now := f.now()
	f.n++
	f.unlogged++
	if f.n == 1 {
		f.first = now
	}
	wait := f.policy.Delay(f.n, f.prev)
	f.prev = wait
	if f.n > 1 && now.Sub(f.logged) < f.every {
		return wait
	}
	in := wait.Round(time.Millisecond)
	fields := watermill.LogFields{"retry_in": in.String(), "failures": f.n}
	if f.n == 1 {
		f.log.Error(fmt.Sprintf("%s; retrying in %s (backing off up to %s while it fails; logged again once per %s)",
			what, in, f.policy.MaxInterval, f.every), err, fields)
	} else {
		f.log.Error(fmt.Sprintf("%s: %d more failure(s) in the last %s, failing for %s; retrying in %s",
			what, f.unlogged, now.Sub(f.logged).Round(time.Second), now.Sub(f.first).Round(time.Second), in), err, fields)
	}
	f.logged, f.unlogged = now, 0
	return wait
}

// ok ends a run of failures, if any, logging that it did (what: e.g.
// "outbox relay").
func (f *failures) ok(what string) {
	if f.n == 0 {
		return
	}
	f.log.Info(fmt.Sprintf("%s: working again after %d failed attempt(s) in %s", what, f.n, f.now().Sub(f.first).Round(time.Millisecond)),
		watermill.LogFields{"failures": f.n})
	f.n, f.unlogged, f.prev = 0, 0, 0
}
