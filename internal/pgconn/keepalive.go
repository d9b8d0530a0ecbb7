package pgconn

import (
	"context"
	"database/sql/driver"
	"fmt"
	"net"
	"strconv"
	"time"

	pgxconn "github.com/jackc/pgx/v5/pgconn"
)

// Keepalive bounds, for every connection millwright opens (Open, OpenPgx,
// PgxConfig, NewConnector; both ends):
//
// The server's side. A session's locks (the idempotency mark of
// Transactional mode, a saga instance's row lock, an advisory lock of a
// cleaner or of migrate) live as long as its backend, and a backend whose
// client vanished without a reset (a frozen VM, a power loss, a partition,
// a dropped NAT or conntrack entry) lives until TCP tells it: with Linux's
// defaults (tcp_keepalives_idle 0 = the OS's 7200 s, then 9 probes 75 s
// apart) about 2 h 11 min, during which every other consumer's redelivery
// of that event waits for the lock and fails. So each new session sets
// tcp_keepalives_idle, tcp_keepalives_interval and tcp_keepalives_count
// (the server probes an idle peer after 30 s, every 10 s, and ends the
// session after 3 unanswered probes) and tcp_user_timeout (what the
// server sent stays unacknowledged for at most 60 s): a vanished client's
// session ends, its transaction rolled back and its locks released,
// within about KeepaliveBound (60 s).
//
// A setting the server already has from anywhere else (the DSN's
// parameters or options=-c ..., PGOPTIONS, ALTER ROLE or DATABASE ... SET,
// postgresql.conf) is kept: only settings whose source is still
// "default" are set. To keep the OS's values, set them to 0 in the DSN
// (tcp_keepalives_idle=0&tcp_keepalives_interval=0&tcp_keepalives_count=0&tcp_user_timeout=0
// in a URL). The settings are ignored on Unix-socket connections, and a
// server without tcp_user_timeout (before 12) just skips it.
//
// The client's side. The socket's own keepalive uses the same idle,
// interval and count (Go's default is 15 s idle, then 9 probes 15 s
// apart), so a client waiting on a server that vanished (a LISTEN
// connection, a pooled connection) learns it within about a minute too.
const (
	KeepaliveIdle        = 30 * time.Second
	KeepaliveInterval    = 10 * time.Second
	KeepaliveCount       = 3
	KeepaliveUserTimeout = 60 * time.Second
	// KeepaliveBound is how long a session whose peer vanished outlives
	// it, at most (plus the kernel's timer granularity): idle + count ×
	// interval.
	KeepaliveBound = KeepaliveIdle + KeepaliveCount*KeepaliveInterval
)

// keepaliveSQL sets the server-side keepalive settings of this session
// that nothing else set, in one statement (one round trip per new
// connection). Joining pg_settings skips a setting the server lacks.
var keepaliveSQL = `SELECT count(set_config(s.name, s.setting, false)) FROM (VALUES ` +
	`('tcp_keepalives_idle', '` + secs(KeepaliveIdle) + `'), ` +
	`('tcp_keepalives_interval', '` + secs(KeepaliveInterval) + `'), ` +
	`('tcp_keepalives_count', '` + strconv.Itoa(KeepaliveCount) + `'), ` +
	`('tcp_user_timeout', '` + strconv.FormatInt(KeepaliveUserTimeout.Milliseconds(), 10) + `')` +
	`) AS s(name, setting) JOIN pg_catalog.pg_settings p ON p.name = s.name WHERE p.source = 'default'`

func secs(d time.Duration) string { return strconv.FormatInt(int64(d/time.Second), 10) }

// clientKeepalive is the client socket's keepalive (see above).
var clientKeepalive = net.KeepAliveConfig{Enable: true, Idle: KeepaliveIdle, Interval: KeepaliveInterval, Count: KeepaliveCount}

// newNetDialer is the net.Dialer of every connection millwright opens.
func newNetDialer() *net.Dialer { return &net.Dialer{KeepAliveConfig: clientKeepalive} }

func keepaliveError(addr string, err error) error {
	return fmt.Errorf("postgres at %s: setting the new session's TCP keepalives (tcp_keepalives_idle, tcp_keepalives_interval, tcp_keepalives_count, tcp_user_timeout; a DSN that sets all four skips this): %w", addr, err)
}

// keepaliveSettings are the settings keepaliveSQL sets.
var keepaliveSettings = []string{"tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout"}

// keepalivesGiven reports whether the DSN's run-time parameters set every
// keepalive setting, so that keepaliveSQL would set none: a DSN that sets
// them all costs no round trip.
func keepalivesGiven(params map[string]string) bool {
	for _, name := range keepaliveSettings {
		if _, ok := params[name]; !ok {
			return false
		}
	}
	return true
}

// setKeepalives runs keepaliveSQL on a new connection of Open, within
// the connect timeout (0: none) and ctx.
func (c *conn) setKeepalives(ctx context.Context, timeout time.Duration) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	end := c.guard(ctx, "the session's keepalive settings")
	_, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, keepaliveSQL, nil)
	if err = end(err); err != nil {
		return keepaliveError(c.addr, err)
	}
	return nil
}

// withPgxKeepalives gives cfg (a pgx connection config) both sides'
// keepalives: its dialer's, and keepaliveSQL after connecting (after the
// caller's own AfterConnect, if any).
func withPgxKeepalives(cfg *pgxconn.Config) {
	cfg.DialFunc = newNetDialer().DialContext
	if keepalivesGiven(cfg.RuntimeParams) {
		return
	}
	prev := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, pc *pgxconn.PgConn) error {
		if prev != nil {
			if err := prev(ctx, pc); err != nil {
				return err
			}
		}
		// pgx bounds the connect by ConnectTimeout, not AfterConnect: a
		// server silent after the startup would hang it.
		if cfg.ConnectTimeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, cfg.ConnectTimeout)
			defer cancel()
		}
		if _, err := pc.Exec(ctx, keepaliveSQL).ReadAll(); err != nil {
			return keepaliveError(pc.Conn().RemoteAddr().String(), err)
		}
		return nil
	}
}
