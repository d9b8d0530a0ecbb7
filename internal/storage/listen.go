package storage

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/pgconn"
)

// Notification is one NOTIFY a Listener received.
type Notification struct {
	Channel string
	Payload string
}

// Listener LISTENs on a channel on a connection of its own, outside any
// pool, and reconnects when the connection is lost: when the server ends
// it (the read fails at once), and when it goes silent (a dropped NAT or
// conntrack entry, a proxy or middlebox that stopped forwarding: no RST,
// no FIN, a read that would wait for TCP keepalive, minutes or forever),
// which a ping unanswered within PingTimeout finds.
type Listener interface {
	// Listen starts listening on channel and returns once the LISTEN is
	// in effect, or with an error: the first connection failed (within its
	// connect_timeout), or ctx ended.
	Listen(ctx context.Context, channel string) error
	// Notifications delivers the notifications received, and a nil after
	// each reconnection (notifications may have been missed). It is closed
	// once the Listener is closed or its ctx ends.
	Notifications() <-chan *Notification
	// Close ends the Listener and its connection; idempotent.
	Close() error
}

// ListenerConfig configures NewListener.
type ListenerConfig struct {
	// URL is the Postgres URL the listener connects to (connect_timeout
	// defaults to pgconn.DefaultConnectTimeout).
	URL string
	// MinReconnect and MaxReconnect bound the wait between reconnection
	// attempts (defaults 100ms and 10s).
	MinReconnect, MaxReconnect time.Duration
	// PingInterval is how often the listener checks that its connection
	// is alive (pgx: after that long without a notification; lib/pq:
	// every PingInterval), with an empty query that must be answered
	// within PingTimeout, or the connection counts as lost: it is closed
	// and replaced, and a nil is delivered. A silent connection is so
	// found within PingInterval + PingTimeout. Default 30s; -1 disables
	// the ping (a silent connection is then found only by TCP keepalive,
	// if ever).
	PingInterval time.Duration
	// PingTimeout bounds each ping. Default PingInterval, at most 10s.
	PingTimeout time.Duration
	// OnEvent, if set, is called with each connection failure.
	OnEvent func(event string, err error)
}

// DefaultListenerPingInterval is ListenerConfig.PingInterval's default.
const DefaultListenerPingInterval = 30 * time.Second

// errPingTimeout: the listener's connection did not answer its ping.
type errPingTimeout struct{ after time.Duration }

func (e errPingTimeout) Error() string {
	return fmt.Sprintf("storage: the LISTEN connection did not answer a ping within %s (silently cut: a dropped NAT entry, a proxy or pooler; replacing it)", e.after)
}

// NewListener returns a Listener of driver d on cfg.URL: lib/pq's
// pq.Listener for DriverSQL, a pgx.Conn waiting in WaitForNotification for
// DriverPgx. It, its connections and its connection attempts end when
// ctx does.
func NewListener(ctx context.Context, d Driver, cfg ListenerConfig) (Listener, error) {
	if cfg.MinReconnect <= 0 {
		cfg.MinReconnect = 100 * time.Millisecond
	}
	if cfg.MaxReconnect < cfg.MinReconnect {
		cfg.MaxReconnect = max(10*time.Second, cfg.MinReconnect)
	}
	if cfg.OnEvent == nil {
		cfg.OnEvent = func(string, error) {}
	}
	switch {
	case cfg.PingInterval == 0:
		cfg.PingInterval = DefaultListenerPingInterval
	case cfg.PingInterval < 0:
		cfg.PingInterval = 0 // none
	}
	if cfg.PingTimeout <= 0 {
		cfg.PingTimeout = min(cfg.PingInterval, 10*time.Second)
	}
	switch d {
	case DriverSQL:
		return newPQListener(ctx, cfg), nil
	case DriverPgx:
		return newPgxListener(ctx, cfg)
	}
	return nil, fmt.Errorf("storage: no listener for driver %q", d)
}

// OpenSession returns a pool of one connection of driver d on url, for
// session state (an advisory lock) that must stay on one connection, and
// the function that closes it. Connection attempts are bounded
// (connect_timeout), and calls end with their ctx.
func OpenSession(ctx context.Context, d Driver, url string) (Pool, func(), error) {
	switch d {
	case DriverSQL:
		db, err := pgconn.Open(url)
		if err != nil {
			return nil, nil, err
		}
		db.SetMaxOpenConns(1)
		db.SetMaxIdleConns(1)
		return NewSQLPool(db), func() { _ = db.Close() }, nil
	case DriverPgx:
		cfg, err := pgconn.PgxConfig(url)
		if err != nil {
			return nil, nil, err
		}
		cfg.MinConns, cfg.MaxConns = 0, 1
		// The session's lock must not go with a connection the pool
		// retires on its own.
		cfg.MaxConnLifetime, cfg.MaxConnIdleTime = math.MaxInt64, math.MaxInt64
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, nil, err
		}
		return NewPgxPool(p), p.Close, nil
	}
	return nil, nil, fmt.Errorf("storage: no session for driver %q", d)
}
