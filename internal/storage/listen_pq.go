package storage

import (
	"context"
	"sync"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/pgconn"
)

// pqListener is lib/pq's Listener (through pgconn.NewListener: its
// connections end with ctx), its notifications translated.
type pqListener struct {
	l    *pq.Listener
	ch   chan *Notification
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

func newPQListener(ctx context.Context, cfg ListenerConfig) *pqListener {
	l := pgconn.NewListener(ctx, cfg.URL, cfg.MinReconnect, cfg.MaxReconnect, func(ev pq.ListenerEventType, err error) {
		if err != nil {
			cfg.OnEvent(pqEvent(ev), err)
		}
	})
	pl := &pqListener{l: l, ch: make(chan *Notification, 64), stop: make(chan struct{}), done: make(chan struct{})}
	go pl.forward()
	go func() { // ctx ends the Listener, as it does pgx's
		select {
		case <-ctx.Done():
			_ = pl.Close()
		case <-pl.stop:
		}
	}()
	return pl
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

func (pl *pqListener) forward() {
	defer close(pl.done)
	defer close(pl.ch)
	for {
		select {
		case <-pl.stop:
			return
		case n, ok := <-pl.l.NotificationChannel():
			if !ok {
				return
			}
			var out *Notification
			if n != nil {
				out = &Notification{Channel: n.Channel, Payload: n.Extra}
			}
			select {
			case pl.ch <- out:
			case <-pl.stop:
				return
			}
		}
	}
}

// Listen waits for a connection as long as it takes: ctx stops it.
func (pl *pqListener) Listen(ctx context.Context, channel string) error {
	listened := make(chan error, 1)
	go func() { listened <- pl.l.Listen(channel) }()
	select {
	case err := <-listened:
		return err
	case <-ctx.Done():
		_ = pl.Close()
		<-listened
		return context.Cause(ctx)
	}
}

func (pl *pqListener) Notifications() <-chan *Notification { return pl.ch }

func (pl *pqListener) Close() error {
	var err error
	pl.once.Do(func() {
		close(pl.stop)
		err = pl.l.Close()
		<-pl.done
	})
	return err
}
