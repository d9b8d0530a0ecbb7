package storage

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/pgconn"
)

// pqListener is lib/pq's Listener (through pgconn.NewListener: its
// connections end with ctx), its notifications translated. lib/pq
// reconnects on its own when a read fails (the server ended the
// connection), but not when the connection goes silent: its reads then
// wait for TCP keepalive (minutes, or forever through a proxy that still
// answers it), and its Ping waits as long, holding the Listener's lock
// (its Close too). So every PingInterval the connection is pinged; a ping
// unanswered within PingTimeout closes that Listener (its context closes
// the socket, which ends the ping and frees the lock) and opens another,
// which LISTENs again, and a nil is delivered.
type pqListener struct {
	cfg    ListenerConfig
	ctx    context.Context // ends the listener
	cancel context.CancelFunc
	ch     chan *Notification
	done   chan struct{}
	once   sync.Once

	mu      sync.Mutex
	started bool
}

// pqConn is one lib/pq Listener and the cancel of the context its
// connections end with.
type pqConn struct {
	l      *pq.Listener
	cancel context.CancelFunc
}

// close closes g's socket first (a Ping waiting on a silent connection
// holds the Listener's lock, which Close needs), then g.
func (g *pqConn) close() {
	g.cancel()
	_ = g.l.Close()
}

func newPQListener(ctx context.Context, cfg ListenerConfig) *pqListener {
	lctx, cancel := context.WithCancel(ctx)
	return &pqListener{cfg: cfg, ctx: lctx, cancel: cancel, ch: make(chan *Notification, 64), done: make(chan struct{})}
}

func pqEvent(ev pq.ListenerEventType) string {
	switch ev {
	case pq.ListenerEventConnected:
		return "connected"
	case pq.ListenerEventDisconnected:
		return "disconnected"
	case pq.ListenerEventReconnected:
		return "reconnected"
	default:
		return "connection attempt failed"
	}
}

// open starts a lib/pq Listener on channel and waits for its LISTEN as
// long as it takes (lib/pq retries its connection with backoff): ctx or
// the listener's end stops it.
func (pl *pqListener) open(ctx context.Context, channel string) (*pqConn, error) {
	gctx, cancel := context.WithCancel(pl.ctx)
	g := &pqConn{cancel: cancel, l: pgconn.NewListener(gctx, pl.cfg.URL, pl.cfg.MinReconnect, pl.cfg.MaxReconnect,
		func(ev pq.ListenerEventType, err error) {
			if err != nil {
				pl.cfg.OnEvent(pqEvent(ev), err)
			}
		})}
	listened := make(chan error, 1)
	go func() { listened <- g.l.Listen(channel) }()
	select {
	case err := <-listened:
		if err != nil {
			g.close()
			return nil, err
		}
		return g, nil
	case <-ctx.Done():
		g.close()
		<-listened
		return nil, context.Cause(ctx)
	case <-pl.ctx.Done():
		g.close()
		<-listened
		return nil, context.Cause(pl.ctx)
	}
}

// Listen waits for a connection as long as it takes: ctx stops it (and
// closes the listener).
func (pl *pqListener) Listen(ctx context.Context, channel string) error {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if pl.started {
		return errors.New("storage: the listener already listens (one channel per listener)")
	}
	g, err := pl.open(ctx, channel)
	if err != nil {
		if ctx.Err() != nil {
			pl.cancel()
		}
		return err
	}
	pl.started = true
	go pl.run(g, channel)
	return nil
}

// run forwards g's notifications until the listener ends, replacing g
// when its connection stops answering pings.
func (pl *pqListener) run(g *pqConn, channel string) {
	defer close(pl.done)
	defer close(pl.ch)
	for {
		err := pl.forward(g)
		g.close()
		if err == nil || pl.ctx.Err() != nil {
			return
		}
		pl.cfg.OnEvent("disconnected", err)
		wait := pl.cfg.MinReconnect
		for {
			if g, err = pl.open(pl.ctx, channel); err == nil {
				break
			}
			if pl.ctx.Err() != nil {
				return
			}
			pl.cfg.OnEvent("connection attempt failed", err)
			t := time.NewTimer(wait)
			select {
			case <-pl.ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			wait = min(2*wait, pl.cfg.MaxReconnect)
		}
		if !pl.deliver(nil) { // some notifications may have been missed
			g.close()
			return
		}
	}
}

// forward delivers g's notifications (a nil after each of lib/pq's own
// reconnections) and pings g every PingInterval. It returns nil when the
// listener ends, and the ping's failure when g did not answer it in time.
func (pl *pqListener) forward(g *pqConn) error {
	var tick <-chan time.Time
	if pl.cfg.PingInterval > 0 {
		t := time.NewTicker(pl.cfg.PingInterval)
		defer t.Stop()
		tick = t.C
	}
	var (
		pinged   chan error // non-nil while a ping is out
		deadline *time.Timer
		late     <-chan time.Time
	)
	defer func() {
		if deadline != nil {
			deadline.Stop()
		}
	}()
	for {
		select {
		case <-pl.ctx.Done():
			return nil
		case n, ok := <-g.l.NotificationChannel():
			if !ok {
				return nil // closed: only Close does that
			}
			var out *Notification
			if n != nil {
				out = &Notification{Channel: n.Channel, Payload: n.Extra}
			}
			if !pl.deliver(out) {
				return nil
			}
		case <-tick:
			if pinged != nil {
				continue
			}
			pinged = make(chan error, 1)
			go func(ch chan<- error) { ch <- recoverPing(g.l.Ping) }(pinged)
			deadline = time.NewTimer(pl.cfg.PingTimeout)
			late = deadline.C
		case err := <-pinged:
			pinged, late = nil, nil
			deadline.Stop()
			if errors.Is(err, errPingPanicked) {
				return err
			}
			// Another error is lib/pq's Listener without a connection:
			// it reconnects on its own and delivers a nil then.
		case <-late:
			select {
			case <-pinged: // answered as the deadline passed
				pinged, late = nil, nil
				continue
			default:
			}
			return errPingTimeout{pl.cfg.PingTimeout}
		}
	}
}

var errPingPanicked = errors.New("storage: lib/pq's Listener ping panicked")

// recoverPing runs ping, turning a panic into an error: lib/pq's
// ListenerConn.Ping panics when the server answers its empty query with
// an error ("shouldn't happen"), which would end the process from this
// goroutine. A failed ping replaces the connection.
func recoverPing(ping func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errPingPanicked, r)
		}
	}()
	return ping()
}

func (pl *pqListener) deliver(n *Notification) bool {
	select {
	case pl.ch <- n:
		return true
	case <-pl.ctx.Done():
		return false
	}
}

func (pl *pqListener) Notifications() <-chan *Notification { return pl.ch }

func (pl *pqListener) Close() error {
	pl.once.Do(func() {
		pl.cancel()
		pl.mu.Lock()
		started := pl.started
		pl.mu.Unlock()
		if started {
			<-pl.done
		} else {
			close(pl.ch)
		}
	})
	return nil
}
