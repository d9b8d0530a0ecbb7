package sql

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/storage"
)

// The wake-up lock (see storage.NewSQLWakeLock and the trigger in
// internal/storage/sqlnotify.go): writers notify only while some consumer
// holds their table's lock exclusively. The transport holds it, on one
// connection of its own (session locks), while at least one of its
// subscriptions on the table is armed: it found the table empty after the
// lock was taken and waits. A woken subscription disarms before it
// queries; the last one to disarm gives the lock back, notifying the
// handover so that other processes' subscriptions relying on it take it.

// lockTimeout bounds each statement on the lock connection.
const lockTimeout = 5 * time.Second

type wakeLocks struct {
	url  string
	live func() bool // the LISTEN is in effect: notifications would come

	mu   sync.Mutex
	db   *stdsql.DB // one connection, opened on first use
	conn *stdsql.Conn
	pid  atomic.Int64 // conn's backend pid: its own handovers are ignored (read without mu)
	sess storage.BackendSession
	// stale are the sessions dropped since the last connection: alive on
	// the server, maybe (a silent connection), holding their locks; the
	// next connection ends them.
	stale  []storage.BackendSession
	ended  atomic.Int64 // stale sessions ended (tests)
	tables map[uint32]*tableLock
	// stopped: the transport closes; no lock is taken again.
	stopped bool
}

type tableLock struct {
	oid   uint32
	lock  storage.SQLWakeLock
	held  bool
	armed map[*waker]struct{}
}

func newWakeLocks(url string, live func() bool) *wakeLocks {
	return &wakeLocks{url: url, live: live, tables: map[uint32]*tableLock{}}
}

// errNotListening: while the LISTEN connection is down no lock is taken
// (its notifications could not come; the lock connection, on the same
// URL, is likely down too, and the consume loop must not wait on it).
var errNotListening = errors.New("the wake-up LISTEN connection is down")

// ownPID returns the lock connection's pid (0 when none).
func (l *wakeLocks) ownPID() int {
	return int(l.pid.Load())
}

func (l *wakeLocks) querier(ctx context.Context) (storage.Querier, error) {
	if l.conn == nil {
		if l.db == nil {
			// pgconn: a statement whose ctx ends is abandoned and its
			// connection closed, so a silent connection cannot hold mu
			// (and every subscription's arm) past lockTimeout.
			db, err := pgconn.Open(l.url)
			if err != nil {
				return nil, err
			}
			db.SetMaxOpenConns(1)
			l.db = db
		}
		c, err := l.db.Conn(ctx)
		if err != nil {
			return nil, err
		}
		sess, err := storage.ThisSession(ctx, storage.NewSQL(c))
		if err != nil {
			_ = c.Close()
			return nil, err
		}
		l.conn, l.sess = c, sess
		l.pid.Store(int64(sess.PID))
		l.endStale(ctx)
	}
	return storage.NewSQL(l.conn), nil
}

// endStale ends the sessions dropped before, if they still run (best
// effort: another role's session needs pg_signal_backend). A silent
// connection's session stays on the server, idle, until TCP keepalive
// finds it (hours by default), holding its wake-up locks: writers would
// notify all along, and this transport's loops would rely on it,
// trying the lock every second.
func (l *wakeLocks) endStale(ctx context.Context) {
	for _, s := range l.stale {
		if ended, err := storage.EndSession(ctx, storage.NewSQL(l.conn), s); err == nil && ended {
			l.ended.Add(1)
		}
	}
	l.stale = nil
}

// check verifies, within timeout, that the lock session still holds
// every lock this transport believes it holds (nothing to do when it
// holds none). On an error (the session ended, or silent) or a lock gone,
// it drops the session and wakes the subscriptions armed on it, and
// returns why.
func (l *wakeLocks) check(ctx context.Context, timeout time.Duration) error {
	l.mu.Lock()
	var want []*tableLock
	for _, tl := range l.tables {
		if tl.held {
			want = append(want, tl)
		}
	}
	if l.conn == nil || len(want) == 0 {
		l.mu.Unlock()
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	held, err := storage.SQLWakeLocksHeld(cctx, storage.NewSQL(l.conn))
	cancel()
	if err != nil && ctx.Err() != nil {
		l.mu.Unlock()
		return nil // stopping
	}
	if err != nil {
		err = fmt.Errorf("checking the wake-up lock session (pid %d): %w", l.pid.Load(), err)
	} else {
		for _, tl := range want {
			if _, ok := held[tl.oid]; !ok {
				err = fmt.Errorf("the wake-up lock session (pid %d) no longer holds the lock of table %s", l.pid.Load(), tl.lock.Table())
				break
			}
		}
	}
	if err == nil {
		l.mu.Unlock()
		return nil
	}
	lost := l.dropLocked()
	l.mu.Unlock()
	wakeEach(lost)
	return err
}

// isArmed reports whether w waits with its table's lock held.
func (l *wakeLocks) isArmed(w *waker) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	tl := l.tables[w.table]
	if tl == nil || !tl.held {
		return false
	}
	_, ok := tl.armed[w]
	return ok
}

// arm takes w's table lock (or joins this transport's hold of it) and
// reports the state: with SQLWakeHeld w is armed (disarm gives its share
// back); with SQLWakeOther another session holds it; with SQLWakeWriters
// writers hold it shared and nothing was taken.
func (l *wakeLocks) arm(ctx context.Context, w *waker) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, lockTimeout)
	defer cancel()
	l.mu.Lock()
	tl := l.tables[w.table]
	if tl == nil {
		tl = &tableLock{oid: w.table, lock: storage.NewSQLWakeLock(w.table, w.quoted), armed: map[*waker]struct{}{}}
		l.tables[w.table] = tl
	}
	if l.stopped || !l.live() {
		l.mu.Unlock()
		return "", errNotListening
	}
	state := storage.SQLWakeHeld
	if !tl.held { // else held since before, by this session
		q, err := l.querier(ctx)
		if err == nil {
			state, err = tl.lock.Try(ctx, q)
		}
		if err != nil {
			lost := l.dropLocked()
			l.mu.Unlock()
			wakeEach(lost)
			return "", err
		}
		tl.held = state == storage.SQLWakeHeld
	}
	if state == storage.SQLWakeHeld {
		tl.armed[w] = struct{}{}
	}
	l.mu.Unlock()
	return state, nil
}

// look reads w's table under its lock (see storage.SQLWakeLock.Look), on
// q (the transport's pool: any session's snapshot taken now is later
// than the lock).
func (l *wakeLocks) look(ctx context.Context, q storage.Querier, w *waker, offsetsTable, group string) (storage.SQLWakeLook, error) {
	ctx, cancel := context.WithTimeout(ctx, lockTimeout)
	defer cancel()
	return storage.NewSQLWakeLock(w.table, w.quoted).Look(ctx, q, offsetsTable, group)
}

// disarm takes w out of its table's hold, giving the lock back when w was
// the last one armed.
func (l *wakeLocks) disarm(w *waker) {
	l.mu.Lock()
	tl := l.tables[w.table]
	if tl == nil {
		l.mu.Unlock()
		return
	}
	if _, ok := tl.armed[w]; !ok {
		l.mu.Unlock()
		return
	}
	delete(tl.armed, w)
	var lost []*waker
	if len(tl.armed) == 0 && tl.held {
		tl.held = false
		ctx, cancel := context.WithTimeout(context.Background(), lockTimeout)
		if !l.live() {
			lost = l.dropLocked() // do not wait on a connection likely cut
		} else if q, err := l.querier(ctx); err != nil || tl.lock.Unlock(ctx, q) != nil {
			lost = l.dropLocked() // closing the session releases it
		}
		cancel()
	}
	l.mu.Unlock()
	wakeEach(lost)
}

// release gives every lock back, each with its handover (other
// processes' subscriptions relying on this transport's hold wake and one
// takes it: closing the connection would release the locks silently, and
// they would sleep until their poll), then drops them. With stop no lock
// is taken again. Called when the transport stops and when its listener
// reconnected.
func (l *wakeLocks) release(stop bool) {
	l.mu.Lock()
	l.stopped = l.stopped || stop
	if l.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		for _, tl := range l.tables {
			if tl.held && tl.lock.Unlock(ctx, storage.NewSQL(l.conn)) != nil {
				break // the connection's end releases the rest
			}
			tl.held = false
		}
		cancel()
	}
	lost := l.dropLocked()
	l.mu.Unlock()
	wakeEach(lost)
}

// releaseTimeout bounds release's statements: on a cut connection it
// gives up soon, and closing the session releases the locks anyway.
const releaseTimeout = time.Second

// drop forgets every lock and closes the connection (the server releases
// what it held); the armed subscriptions are woken to take them again.
// Called when the listener reconnected (the lock connection may have been
// cut too) and on the lock connection's errors.
func (l *wakeLocks) drop() {
	l.mu.Lock()
	lost := l.dropLocked()
	l.mu.Unlock()
	wakeEach(lost)
}

func (l *wakeLocks) dropLocked() []*waker {
	var lost []*waker
	for _, tl := range l.tables {
		for w := range tl.armed {
			lost = append(lost, w)
		}
		tl.held, tl.armed = false, map[*waker]struct{}{}
	}
	if l.conn != nil {
		// Closing a silent connection does not reach the server: its
		// session may live on with the locks it held. The next
		// connection ends it (endStale); a session that ended is not
		// found then.
		if len(l.stale) < 8 {
			l.stale = append(l.stale, l.sess)
		}
		_ = l.conn.Close()
		l.conn = nil
		l.pid.Store(0)
	}
	if l.db != nil {
		_ = l.db.Close()
		l.db = nil
	}
	return lost
}

func wakeEach(ws []*waker) {
	for _, w := range ws {
		w.notify(0)
	}
}
