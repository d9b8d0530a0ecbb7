package sql

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
)

// The wake-up: every messages table has a trigger that NOTIFYs
// storage.SQLNotifyChannel at the commit of each inserting transaction
// while a consumer waits, i.e. holds the table's wake-up lock (see
// wakelock.go, and internal/storage/sqlnotify.go for why a trigger and
// not the publisher). The transport LISTENs on one connection of its own and wakes
// the consume loop of the table named in the payload; that loop, idle in
// watermill-sql's BackoffManager between queries, queries again at once.
//
// watermill-sql reads only rows whose transaction id is below the xmin
// horizon (pg_snapshot_xmin): a row committed while an older transaction
// still runs is not visible yet, and that older transaction may never
// notify (it need not write to this table). So the loop remembers the
// highest transaction id notified, and after an empty query re-reads the
// horizon (every eighth of the time waited so far, from 1 ms up to
// PollInterval) until it has passed that id,
// then queries once more. A notification that never comes (the LISTEN
// connection was down, the payload was lost) costs at most one
// PollInterval: the poll stays.

// notifier owns the LISTEN connection of a transport and hands each
// notification to the wakers of its table.
type notifier struct {
	url    string
	logger watermill.LoggerAdapter
	// check is Config.WakeCheckInterval (0: no checks): how often the
	// LISTEN connection is pinged and the lock session's locks checked,
	// and how long each may take.
	check  time.Duration
	ctx    context.Context
	cancel context.CancelFunc
	ready  chan struct{} // closed once the first LISTEN is in effect
	done   chan struct{}
	once   sync.Once

	mu     sync.Mutex
	wakers map[uint32]map[*waker]struct{}

	locks *wakeLocks  // the tables' wake-up locks (wakelock.go)
	live  atomic.Bool // the LISTEN is in effect (else locks are not taken)

	// reconnects counts the listener's reconnections, wakes and polls the
	// queries run on a wake and on the poll's expiry (tests wait on them).
	reconnects, wakes, polls atomic.Int64
	// lockLosses counts the lock sessions found lost by the check
	// (ended, silent, or no longer holding a lock it took).
	lockLosses atomic.Int64
	// waits counts the consume loops' waits begun (after the look that
	// follows taking the lock).
	waits atomic.Int64

	// Tests' hooks, run by a consume loop idle on its table: beforeLock
	// before it tries the lock, beforeLook after it found the lock held
	// and before it looks at the table.
	beforeLock, beforeLook atomic.Pointer[func(table uint32)]
}

func runHook(h *atomic.Pointer[func(uint32)], table uint32) {
	if f := h.Load(); f != nil {
		(*f)(table)
	}
}

func newNotifier(url string, logger watermill.LoggerAdapter, check time.Duration) *notifier {
	ctx, cancel := context.WithCancel(context.Background())
	n := &notifier{url: url, logger: logger, check: check, ctx: ctx, cancel: cancel, ready: make(chan struct{}),
		done: make(chan struct{}), wakers: map[uint32]map[*waker]struct{}{}}
	n.locks = newWakeLocks(url, n.live.Load)
	return n
}

// start starts listening, once; it returns at once.
func (n *notifier) start() {
	n.once.Do(func() { go n.run() })
}

// run LISTENs until the notifier stops, opening a new listener (backing
// off up to 10 s) if the first connection cannot be made.
func (n *notifier) run() {
	defer close(n.done)
	if n.check > 0 {
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			n.watchLocks()
		}()
		defer func() { <-watched }()
	}
	ping := time.Duration(-1) // none
	if n.check > 0 {
		ping = n.check
	}
	wait := 100 * time.Millisecond
	for n.ctx.Err() == nil {
		l, err := storage.NewListener(n.ctx, storage.DriverSQL, storage.ListenerConfig{URL: n.url,
			PingInterval: ping, PingTimeout: n.check,
			OnEvent: func(ev string, err error) {
				n.live.Store(false)
				n.logger.Info("sql: wake-up listener event; consumers poll until it reconnects", watermill.LogFields{"event": ev, "err": redact.ErrorOf(err, n.url).Error()})
			}})
		if err == nil {
			if err = l.Listen(n.ctx, storage.SQLNotifyChannel); err != nil {
				_ = l.Close()
			}
		}
		if err != nil {
			if n.ctx.Err() != nil {
				return
			}
			n.logger.Error("sql: LISTEN for the consumers' wake-up failed; they poll every PollInterval meanwhile (check the URL or ListenURL)", redact.ErrorOf(err, n.url), watermill.LogFields{"retry_in": wait.String()})
			select {
			case <-n.ctx.Done():
				return
			case <-time.After(wait):
			}
			wait = min(2*wait, 10*time.Second)
			continue
		}
		n.live.Store(true)
		close(n.ready)
		n.forward(l)
		_ = l.Close()
		return
	}
}

func (n *notifier) forward(l storage.Listener) {
	for {
		select {
		case <-n.ctx.Done():
			return
		case m, ok := <-l.Notifications():
			if !ok {
				return
			}
			if m == nil {
				// Reconnected: notifications may have been missed.
				// The lock connection may have been cut too: its locks
				// are taken again.
				n.reconnects.Add(1)
				n.locks.release(false)
				n.live.Store(true)
				n.wakeAll()
				continue
			}
			table, xid, ok := storage.ParseSQLNotification(m.Payload)
			if !ok {
				// A handover: another session gave the table's lock back;
				// its waiters (none here if it was this transport's) take it.
				var pid int
				if table, pid, ok = storage.ParseSQLHandover(m.Payload); !ok || pid == n.locks.ownPID() {
					continue
				}
			}
			n.mu.Lock()
			for w := range n.wakers[table] {
				w.notify(xid)
			}
			n.mu.Unlock()
		}
	}
}

// watchLocks checks the lock session every n.check while it holds a
// lock: nothing watches that connection while the consumers wait, and a
// session the server ended (idle_session_timeout, pg_terminate_backend,
// a proxy or pooler dropping an idle connection) releases its locks
// silently: writers stop notifying, while the LISTEN is healthy. A lost
// session is dropped and the subscriptions armed on it are woken: each
// queries once (what committed unnotified since the loss) and takes the
// lock again on a new session.
func (n *notifier) watchLocks() {
	t := time.NewTicker(n.check)
	defer t.Stop()
	for {
		select {
		case <-n.ctx.Done():
			return
		case <-t.C:
		}
		if err := n.locks.check(n.ctx, n.check); err != nil && n.ctx.Err() == nil {
			n.lockLosses.Add(1)
			n.logger.Error("sql: the wake-up lock's session was lost (ended by the server, idle_session_timeout, a proxy or pooler, or silent); taking the locks again on a new connection, the waiting subscribers query now",
				redact.ErrorOf(err, n.url), watermill.LogFields{"check_interval": n.check.String()})
		}
	}
}

func (n *notifier) wakeAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, ws := range n.wakers {
		for w := range ws {
			w.notify(0)
		}
	}
}

// waitReady waits up to d for the LISTEN to be in effect.
func (n *notifier) waitReady(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-n.ready:
		return true
	case <-t.C:
		return false
	}
}

// register returns a waker for the notifications of table (quoted: its
// name, as the schema adapter quotes it) and the function that stops them.
func (n *notifier) register(table uint32, quoted string) (*waker, func()) {
	w := &waker{ch: make(chan struct{}, 1), table: table, quoted: quoted}
	n.mu.Lock()
	if n.wakers[table] == nil {
		n.wakers[table] = map[*waker]struct{}{}
	}
	n.wakers[table][w] = struct{}{}
	n.mu.Unlock()
	return w, func() {
		n.mu.Lock()
		delete(n.wakers[table], w)
		if len(n.wakers[table]) == 0 {
			delete(n.wakers, table)
		}
		n.mu.Unlock()
		n.locks.disarm(w)
	}
}

func (n *notifier) stop() {
	n.cancel()
	n.once.Do(func() { close(n.done) }) // never started
	<-n.done
	n.locks.release(true)
}

// waker is one consume loop's doorbell: a pending wake and the highest
// transaction id notified that the loop has not yet seen pass the horizon.
type waker struct {
	ch      chan struct{} // capacity 1: wakes fold into one
	table   uint32
	quoted  string
	mu      sync.Mutex
	pending uint64 // 0: none

	// Owned by the consume loop (wakeBackoff.arm).
	retry      time.Duration // wait before trying a lock writers hold
	armFailing bool          // the last try of the lock failed (logged)
}

// notify rings the bell; xid 0 (a reconnection) only wakes.
func (w *waker) notify(xid uint64) {
	if xid != 0 {
		w.mu.Lock()
		w.pending = max(w.pending, xid)
		w.mu.Unlock()
	}
	select {
	case w.ch <- struct{}{}:
	default:
	}
}

// raise makes xid pending (0: nothing) without waking.
func (w *waker) raise(xid uint64) {
	w.mu.Lock()
	w.pending = max(w.pending, xid)
	w.mu.Unlock()
}

func (w *waker) pendingXid() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending
}

// passed forgets the pending id once horizon is above it.
func (w *waker) passed(horizon uint64) {
	w.mu.Lock()
	if w.pending < horizon {
		w.pending = 0
	}
	w.mu.Unlock()
}

// wakeBackoff is watermill-sql's BackoffManager for one consume loop:
// errors and non-empty queries as watermill-sql's default; after an empty
// query it waits, instead of sleeping PollInterval, for whichever comes
// first: a wake (query again now), the horizon passing the highest
// notified transaction (query again now: its rows became visible), the
// poll interval (the fallback), or the subscription's end.
type wakeBackoff struct {
	n     *notifier
	w     *waker
	def   wsql.BackoffManager
	poll  time.Duration
	xmin  func(ctx context.Context) (uint64, error)
	look  func(ctx context.Context) (storage.SQLWakeLook, error)
	ctx   context.Context // the subscription's
	close <-chan struct{} // the subscriber's Close
}

// minRecheck is the first wait before the horizon is read again.
const minRecheck = time.Millisecond

// recheckAfter is the wait before the horizon is read again, elapsed into
// a wait for it: an eighth of elapsed, from minRecheck up to poll. A row
// is then seen at most an eighth later than its horizon passed it (a
// doubling wait would add up to the whole hold again: 64 ms more for a
// hold of 70 ms), with about 8 reads per doubling of the hold (some 70
// over a minute).
func recheckAfter(elapsed, poll time.Duration) time.Duration {
	return min(max(elapsed/8, minRecheck), poll)
}

func (b *wakeBackoff) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	if err != nil || !noMsg {
		return b.def.HandleError(logger, noMsg, err)
	}
	d, wait, rely := b.arm(logger)
	if !wait {
		return d
	}
	b.n.waits.Add(1)
	limit := time.Duration(0)
	if rely {
		limit = min(relyRecheck, b.poll)
	}
	d = b.wait(limit)
	if d == 0 {
		b.n.locks.disarm(b.w) // busy: writers need not notify
	}
	return d
}

// relyRecheck bounds a wait that relies on another session's hold of the
// lock: a holder that gives it back notifies its handover, but one whose
// session ends otherwise (its process killed, its connection cut)
// releases it silently, and writers stop notifying; the loop then takes
// the lock itself within this long (one query and one statement a
// second per idle subscription relying on another process).
const relyRecheck = time.Second

// arm makes writers notify before the loop waits (wait true), or tells the
// loop to query again after d (wait false). It takes the table's wake-up
// lock (or joins this transport's hold of it, or relies on another
// session's: rely), then looks at the table in a statement of its own
// (see doc.go for why that look loses no commit): rows to read release
// the lock and query now; rows the horizon hides are waited for as
// notified ones are. While writers hold the lock shared it cannot be
// taken: the loop queries again soon (from 1 ms, doubling up to 100 ms
// or PollInterval). A loop already armed (its lock held since it looked)
// waits at once: every commit since then notifies.
func (b *wakeBackoff) arm(logger watermill.LoggerAdapter) (d time.Duration, wait, rely bool) {
	if b.n.locks.isArmed(b.w) {
		return 0, true, false
	}
	runHook(&b.n.beforeLock, b.w.table)
	state, err := b.n.locks.arm(b.ctx, b.w)
	switch {
	case errors.Is(err, errNotListening):
		return 0, true, false // the listener's reconnection wakes the loop; the poll stays
	case err != nil:
		// The lock's connection failed (dropped now): writers may not
		// notify, so the loop tries again on a new one within a second
		// (as when relying on another's hold), not at its poll.
		if b.ctx.Err() == nil && !b.w.armFailing { // logged once per run of failures
			logger.Error("sql: taking the wake-up lock failed; trying again every second, polling meanwhile (check ListenURL)",
				redact.ErrorOf(err, b.n.url), watermill.LogFields{"table": b.w.quoted})
		}
		b.w.armFailing = true
		return 0, true, true
	case state == storage.SQLWakeWriters:
		b.w.retry = min(max(2*b.w.retry, time.Millisecond), 100*time.Millisecond, b.poll)
		return b.waitRetry(b.w.retry), false, false
	}
	b.w.retry, b.w.armFailing = 0, false
	runHook(&b.n.beforeLook, b.w.table)
	look, err := b.look(b.ctx)
	if err != nil || look.Backlog {
		// Busy (or blind): give the lock up and query now; a failing
		// database then backs off in watermill-sql's loop.
		b.n.locks.disarm(b.w)
		return 0, false, false
	}
	b.w.passed(look.Horizon) // notified rows below it: the look saw them
	b.w.raise(look.Hidden)
	return 0, true, state == storage.SQLWakeOther
}

// waitRetry waits d before the lock is tried again, or less if woken.
func (b *wakeBackoff) waitRetry(d time.Duration) time.Duration {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-b.ctx.Done():
		return b.poll
	case <-b.close:
		return b.poll
	case <-b.w.ch:
		b.n.wakes.Add(1)
	case <-t.C:
	}
	return 0
}

// wait waits, the table's lock taken (or another session's hold relied
// on), for a wake, the horizon passing the pending id, the poll, limit
// (0: none) or the end.
func (b *wakeBackoff) wait(limit time.Duration) time.Duration {
	poll := time.NewTimer(b.poll)
	defer poll.Stop()
	var relied <-chan time.Time
	if limit > 0 {
		t := time.NewTimer(limit)
		defer t.Stop()
		relied = t.C
	}
	recheck := time.NewTimer(minRecheck)
	defer recheck.Stop()
	begun := time.Now()
	for {
		var again <-chan time.Time
		if p := b.w.pendingXid(); p != 0 {
			h, err := b.xmin(b.ctx)
			if err == nil && h > p {
				b.w.passed(h)
				return 0
			}
			if err == nil {
				recheck.Reset(recheckAfter(time.Since(begun), b.poll))
				again = recheck.C
			}
			// A failed read: the poll (or a wake) takes over.
		}
		select {
		case <-b.ctx.Done():
			// Not 0: watermill-sql's loop then picks the ctx's end, not
			// one more query.
			return b.poll
		case <-b.close:
			return b.poll
		case <-b.w.ch:
			b.n.wakes.Add(1)
			return 0
		case <-poll.C:
			b.n.polls.Add(1)
			return 0
		case <-relied:
			return 0
		case <-again:
		}
	}
}
