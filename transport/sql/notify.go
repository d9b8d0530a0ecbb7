package sql

import (
	"context"
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
// (see internal/storage/sqlnotify.go for why a trigger and not the
// publisher). The transport LISTENs on one connection of its own and wakes
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
	ctx    context.Context
	cancel context.CancelFunc
	ready  chan struct{} // closed once the first LISTEN is in effect
	done   chan struct{}
	once   sync.Once

	mu     sync.Mutex
	wakers map[uint32]map[*waker]struct{}

	// reconnects counts the listener's reconnections, wakes and polls the
	// queries run on a wake and on the poll's expiry (tests wait on them).
	reconnects, wakes, polls atomic.Int64
}

func newNotifier(url string, logger watermill.LoggerAdapter) *notifier {
	ctx, cancel := context.WithCancel(context.Background())
	return &notifier{url: url, logger: logger, ctx: ctx, cancel: cancel, ready: make(chan struct{}),
		done: make(chan struct{}), wakers: map[uint32]map[*waker]struct{}{}}
}

// start starts listening, once; it returns at once.
func (n *notifier) start() {
	n.once.Do(func() { go n.run() })
}

// run LISTENs until the notifier stops, opening a new listener (backing
// off up to 10 s) if the first connection cannot be made.
func (n *notifier) run() {
	defer close(n.done)
	wait := 100 * time.Millisecond
	for n.ctx.Err() == nil {
		l, err := storage.NewListener(n.ctx, storage.DriverSQL, storage.ListenerConfig{URL: n.url,
			OnEvent: func(ev string, err error) {
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
				n.reconnects.Add(1)
				n.wakeAll()
				continue
			}
			table, xid, ok := storage.ParseSQLNotification(m.Payload)
			if !ok {
				continue
			}
			n.mu.Lock()
			for w := range n.wakers[table] {
				w.notify(xid)
			}
			n.mu.Unlock()
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

// register returns a waker for table's notifications and the function
// that stops them.
func (n *notifier) register(table uint32) (*waker, func()) {
	w := &waker{ch: make(chan struct{}, 1)}
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
	}
}

func (n *notifier) stop() {
	n.cancel()
	n.once.Do(func() { close(n.done) }) // never started
	<-n.done
}

// waker is one consume loop's doorbell: a pending wake and the highest
// transaction id notified that the loop has not yet seen pass the horizon.
type waker struct {
	ch      chan struct{} // capacity 1: wakes fold into one
	mu      sync.Mutex
	pending uint64 // 0: none
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
	poll := time.NewTimer(b.poll)
	defer poll.Stop()
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
		case <-again:
		}
	}
}
