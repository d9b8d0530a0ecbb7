package storage

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	mwpgconn "github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
)

// pgxListener LISTENs on a pgx.Conn of its own and waits in
// WaitForNotification, pinging the connection after PingInterval without
// a notification; on a lost connection (a failed read, or a ping
// unanswered within PingTimeout) it reconnects (backing off from
// MinReconnect to MaxReconnect), LISTENs again and delivers a nil.
// Every connection attempt is bounded by connect_timeout, and ends with
// ctx or Close.
type pgxListener struct {
	cfg     ListenerConfig
	connCfg *pgx.ConnConfig
	ctx     context.Context
	cancel  context.CancelFunc
	ch      chan *Notification
	done    chan struct{}
	once    sync.Once
	started bool
	mu      sync.Mutex
}

func newPgxListener(ctx context.Context, cfg ListenerConfig) (*pgxListener, error) {
	pc, err := mwpgconn.PgxConfig(cfg.URL)
	if err != nil {
		return nil, err
	}
	lctx, cancel := context.WithCancel(ctx)
	return &pgxListener{cfg: cfg, connCfg: pc.ConnConfig, ctx: lctx, cancel: cancel,
		ch: make(chan *Notification, 64), done: make(chan struct{})}, nil
}

// connect opens a connection and LISTENs on channel.
func (l *pgxListener) connect(ctx context.Context, channel string) (*pgx.Conn, error) {
	c, err := pgx.ConnectConfig(ctx, l.connCfg)
	if err != nil {
		return nil, redact.Error(err)
	}
	if _, err := c.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		_ = c.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	return c, nil
}

func (l *pgxListener) Listen(ctx context.Context, channel string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.started {
		return errors.New("storage: the listener already listens (one channel per listener)")
	}
	cctx, stop := context.WithCancel(l.ctx)
	defer stop()
	go func() {
		select {
		case <-ctx.Done():
			stop()
		case <-cctx.Done():
		}
	}()
	c, err := l.connect(cctx, channel)
	if err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		return fmt.Errorf("storage: LISTEN %q: %w", channel, err)
	}
	l.started = true
	go l.run(c, channel)
	return nil
}

// run waits for notifications until the listener's ctx ends, reconnecting
// as needed.
func (l *pgxListener) run(c *pgx.Conn, channel string) {
	defer close(l.done)
	defer close(l.ch)
	wait := l.cfg.MinReconnect
	for {
		if c == nil {
			t := time.NewTimer(wait)
			select {
			case <-l.ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			var err error
			if c, err = l.connect(l.ctx, channel); err != nil {
				if l.ctx.Err() != nil {
					return
				}
				l.cfg.OnEvent("connection attempt failed", err)
				wait = min(2*wait, l.cfg.MaxReconnect)
				continue
			}
			wait = l.cfg.MinReconnect
			if !l.deliver(nil) { // some notifications may have been missed
				_ = c.Close(context.Background())
				return
			}
		}
		n, err := l.wait(c)
		if err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = c.Close(cctx)
			cancel()
			c = nil
			if l.ctx.Err() != nil {
				return
			}
			l.cfg.OnEvent("disconnected", err)
			continue
		}
		if !l.deliver(&Notification{Channel: n.Channel, Payload: n.Payload}) {
			cctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = c.Close(cctx)
			cancel()
			return
		}
	}
}

// wait waits on c for a notification; each PingInterval without one it
// pings c, which must answer within PingTimeout (a WaitForNotification
// ended by its deadline leaves the connection usable: pgx only sets a
// read deadline).
func (l *pgxListener) wait(c *pgx.Conn) (*pgconn.Notification, error) {
	if l.cfg.PingInterval <= 0 {
		return c.WaitForNotification(l.ctx)
	}
	for {
		wctx, cancel := context.WithTimeout(l.ctx, l.cfg.PingInterval)
		n, err := c.WaitForNotification(wctx)
		cancel()
		if err == nil || l.ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) || c.IsClosed() {
			return n, err
		}
		pctx, cancel := context.WithTimeout(l.ctx, l.cfg.PingTimeout)
		err = c.Ping(pctx)
		timedOut := pctx.Err() != nil
		cancel()
		switch {
		case err == nil:
		case l.ctx.Err() != nil:
			return nil, err
		case timedOut:
			return nil, fmt.Errorf("%w: %w", errPingTimeout{l.cfg.PingTimeout}, err)
		default:
			return nil, err
		}
	}
}

func (l *pgxListener) deliver(n *Notification) bool {
	select {
	case l.ch <- n:
		return true
	case <-l.ctx.Done():
		return false
	}
}

func (l *pgxListener) Notifications() <-chan *Notification { return l.ch }

func (l *pgxListener) Close() error {
	l.once.Do(func() {
		l.cancel()
		l.mu.Lock()
		started := l.started
		l.mu.Unlock()
		if started {
			<-l.done
		} else {
			close(l.ch)
		}
	})
	return nil
}
