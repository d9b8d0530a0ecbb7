// Package pgconn opens the Postgres connections millwright makes itself (the
// operator CLI, the Postgres transport, the outbox relay's LISTEN and
// wake-up connections, the examples) so that a server that accepts TCP and
// never answers cannot hang them.
//
// lib/pq bounds a connection attempt only when connect_timeout is set, and
// it watches the context only while dialling TCP: a server that accepts and
// then stays silent keeps it reading the startup reply, deaf to
// cancellation. Here:
//
//   - every DSN gets connect_timeout=10 (DefaultConnectTimeout) when it sets
//     none and PGCONNECT_TIMEOUT is unset (WithConnectTimeout); an explicit
//     connect_timeout=0 keeps libpq's meaning, no limit;
//   - Open's connections give up as soon as the context of the call that
//     opens them ends (Ctrl-C, a deadline), closing the socket;
//   - a statement (ExecContext, QueryContext, Ping, BeginTx, Commit of a
//     transaction begun with a context) whose context ends is abandoned at
//     once, its connection closed, instead of waiting for the server to
//     answer lib/pq's cancel request (a silent server never does);
//   - NewListener's connections are closed when its context ends;
//   - every session sets server-side TCP keepalives (tcp_keepalives_idle
//     30 s, _interval 10 s, _count 3, tcp_user_timeout 60 s) that nothing
//     else set, so that a client that vanished without a reset loses its
//     session, and the locks it holds, within KeepaliveBound (about 60 s)
//     instead of Linux's 2 h 11 min; the client's socket probes the
//     server alike (see KeepaliveIdle).
//
// OpenPgx and PgxConfig give pgx pools the same connect bound and
// keepalives (pgx itself abandons a statement whose context ends).
//
// Open's transactions are begun and ended with simple queries of this
// package's own (BEGIN with lib/pq's options, COMMIT, ROLLBACK) so that
// BEGIN can carry a first statement in the same round trip
// (WithFirstStatement: the storage layer's TxOptions.First on database/sql,
// such as the idempotency mark). Every other statement is sent when it is
// issued, as lib/pq sends it, and its errors are its own. Commit of a
// transaction in which a statement failed returns ErrTxAborted (lib/pq's
// pq.ErrInFailedTransaction).
//
// Errors say what happened: "refused the connection", "accepted the
// connection but did not answer within 10s (connect_timeout)",
// "interrupted while connecting ... (no answer after 1.2s)". Waiting lists
// what is being waited for right now, for a program that must explain why
// it is still running after a signal.
package pgconn

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/deadline"
	"github.com/millwright/millwright/internal/redact"
)

// DefaultConnectTimeout bounds a connection attempt (TCP connect, TLS and
// the startup exchange) when the DSN sets no connect_timeout and
// PGCONNECT_TIMEOUT is unset.
const DefaultConnectTimeout = 10 * time.Second

// WithConnectTimeout returns dsn (a postgres:// URL or a key=value DSN)
// with connect_timeout set to d, rounded up to whole seconds as libpq wants
// (d <= 0: DefaultConnectTimeout), unless the DSN sets connect_timeout
// itself or PGCONNECT_TIMEOUT is set.
func WithConnectTimeout(dsn string, d time.Duration) string {
	if d <= 0 {
		d = DefaultConnectTimeout
	}
	if os.Getenv("PGCONNECT_TIMEOUT") != "" {
		return dsn
	}
	secs := strconv.FormatInt(int64((d+time.Second-1)/time.Second), 10)
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		if strings.Contains(dsn, "connect_timeout=") {
			return dsn
		}
		if strings.TrimSpace(dsn) == "" {
			return "connect_timeout=" + secs
		}
		return dsn + " connect_timeout=" + secs
	}
	q := u.Query()
	if _, ok := q["connect_timeout"]; ok {
		return dsn
	}
	q.Set("connect_timeout", secs)
	// Encode writes a space as '+', which pgx reads as a '+' (it would
	// send options=-c+x=1 to the server); %20 both drivers read as a
	// space. A real '+' is encoded as %2B, so this changes nothing else.
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	return u.String()
}

// Open returns a pool on dsn, as sql.Open("postgres", dsn) would, with the
// bounds of the package doc. The DSN is parsed now: an error names no
// password.
func Open(dsn string) (*sql.DB, error) {
	c, err := NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	return sql.OpenDB(c), nil
}

// OpenWithNotices is Open with every connection handing the server's
// notices (RAISE NOTICE, warnings) to handler, on the goroutine of the
// call that receives them. The CLI reads a migration's progress so.
func OpenWithNotices(dsn string, handler func(*pq.Error)) (*sql.DB, error) {
	c, err := newConnector(dsn)
	if err != nil {
		return nil, err
	}
	c.notice = handler
	return sql.OpenDB(c), nil
}

// NewConnector returns the connector Open uses, for sql.OpenDB.
func NewConnector(dsn string) (driver.Connector, error) { return newConnector(dsn) }

func newConnector(dsn string) (*connector, error) {
	cfg, err := pq.NewConfig(WithConnectTimeout(dsn, 0))
	if err != nil {
		return nil, redact.Error(err)
	}
	return &connector{cfg: cfg, addr: addrOf(cfg)}, nil
}

// addrOf names the server(s) of cfg for messages.
func addrOf(cfg pq.Config) string {
	one := func(host string, port uint16) string {
		if strings.HasPrefix(host, "/") || strings.HasPrefix(host, "@") {
			return host // unix socket directory or abstract socket
		}
		return net.JoinHostPort(host, strconv.Itoa(int(port)))
	}
	s := one(cfg.Host, cfg.Port)
	for _, m := range cfg.Multi {
		s += "," + one(m.Host, m.Port)
	}
	return s
}

type connector struct {
	cfg    pq.Config
	addr   string
	notice func(*pq.Error) // nil: notices are dropped (lib/pq's default)
}

func (c *connector) Driver() driver.Driver { return &pq.Driver{} }

// Connect opens one connection. ctx is that of the call that needs it: when
// it ends, the attempt is abandoned and its socket closed.
func (c *connector) Connect(ctx context.Context) (driver.Conn, error) {
	pc, err := pq.NewConnectorConfig(c.cfg)
	if err != nil {
		return nil, err
	}
	d := &dialer{watch: ctx}
	pc.Dialer(d)
	done := track("postgres at " + c.addr + ": connecting")
	start := time.Now()
	cn, err := pc.Connect(ctx)
	done()
	closed := d.release()
	elapsed := time.Since(start)
	if err == nil && closed {
		// ctx ended as the connection came up: its socket is closed.
		_ = cn.Close()
		err = ctx.Err()
	}
	if err != nil {
		return nil, connectError(ctx, c.addr, c.cfg.ConnectTimeout, d.wasAccepted(), elapsed, err)
	}
	d.mu.Lock()
	nc := d.last // the connection's socket: the last one dialled
	d.mu.Unlock()
	cc := &conn{Conn: cn, nc: nc, addr: c.addr}
	if !keepalivesGiven(c.cfg.Runtime) {
		if err := cc.setKeepalives(ctx, c.cfg.ConnectTimeout); err != nil {
			_ = cn.Close()
			return nil, err
		}
	}
	if c.notice != nil {
		pq.SetNoticeHandler(cn, c.notice)
	}
	return cc, nil
}

// connectError says what went wrong with a connection attempt to addr.
func connectError(ctx context.Context, addr string, timeout time.Duration, accepted bool, elapsed time.Duration, err error) error {
	if deadline.Passed(ctx) {
		cause := context.Cause(ctx)
		if cause == nil {
			cause = context.DeadlineExceeded
		}
		if errors.Is(cause, context.DeadlineExceeded) {
			if accepted {
				return fmt.Errorf("postgres at %s accepted the connection but did not answer within %s: %w", addr, round(elapsed), cause)
			}
			return fmt.Errorf("postgres at %s did not accept a connection within %s: %w", addr, round(elapsed), cause)
		}
		waited := "TCP connect pending"
		if accepted {
			waited = "no answer"
		}
		return fmt.Errorf("interrupted while connecting to postgres at %s (%s after %s): %w", addr, waited, round(elapsed), cause)
	}
	// lib/pq's dial timeout is a net.Error; pgx's connect_timeout ends
	// the connect's own context.
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		if accepted {
			return fmt.Errorf("postgres at %s accepted the connection but did not answer within %s (connect_timeout; is it a Postgres server, and is it overloaded?): %w", addr, timeout, err)
		}
		return fmt.Errorf("postgres at %s did not accept a connection within %s (connect_timeout; check the host, port and firewall): %w", addr, timeout, err)
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("postgres at %s refused the connection after %s (is it running on that port?): %w", addr, round(elapsed), err)
	}
	return err
}

// round keeps durations readable in messages.
func round(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return "<1ms"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	}
	return d.Round(100 * time.Millisecond).String()
}

// dialer is a pq.Dialer whose connections are closed when watch ends,
// until release. The connector makes one per attempt; NewListener one for
// its whole life.
type dialer struct {
	mu       sync.Mutex
	watch    context.Context // nil once released
	forever  bool            // a Listener's: never released
	stops    []func() bool
	last     net.Conn
	accepted bool
	closed   bool // watch ended and closed a connection
}

func (d *dialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

func (d *dialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, network, address)
}

func (d *dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	d.mu.Lock()
	watch := d.watch
	d.mu.Unlock()
	if watch != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		defer context.AfterFunc(watch, cancel)()
	}
	nc, err := newNetDialer().DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.accepted = true
	d.last = nc
	if d.watch == nil {
		return nc, nil
	}
	stop := context.AfterFunc(d.watch, func() {
		d.mu.Lock()
		d.closed = true
		d.mu.Unlock()
		_ = nc.Close()
	})
	if d.forever {
		// The Listener redials after every lost connection: let each
		// connection's Close drop its watch.
		return &watchedConn{Conn: nc, stop: stop}, nil
	}
	d.stops = append(d.stops, stop)
	return nc, nil
}

// watchedConn stops watching its dialer's context when closed.
type watchedConn struct {
	net.Conn
	stop func() bool
}

func (c *watchedConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// release stops watching (later dials, such as lib/pq's cancel requests,
// are not watched) and reports whether the watched context closed a
// connection.
func (d *dialer) release() bool {
	d.mu.Lock()
	stops := d.stops
	d.watch, d.stops = nil, nil
	d.mu.Unlock()
	for _, stop := range stops {
		stop()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

func (d *dialer) wasAccepted() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.accepted
}

// NewListener is pq.NewListener on dsn (with WithConnectTimeout) whose
// connection attempts, and connections, are closed when ctx ends, so that
// neither the Listener's reconnection loop nor its Close can wait on a
// silent server after that. Close the Listener as usual.
func NewListener(ctx context.Context, dsn string, minReconnect, maxReconnect time.Duration, cb pq.EventCallbackType) *pq.Listener {
	return pq.NewDialListener(&dialer{watch: ctx, forever: true}, WithConnectTimeout(dsn, 0), minReconnect, maxReconnect, cb)
}

// in-flight operations, for Waiting: a sync.Map, as every statement adds
// and removes one.
var (
	ops    sync.Map // *op -> struct{}
	nextOp atomic.Uint64
)

type op struct {
	what  string
	start time.Time
	seq   uint64
}

func track(what string) (done func()) {
	o := &op{what: what, start: time.Now(), seq: nextOp.Add(1)}
	ops.Store(o, struct{}{})
	return func() { ops.Delete(o) }
}

// Waiting describes the connection attempts and statements in flight in
// this process, oldest first, each with how long it has waited: "postgres
// at 127.0.0.1:5432: connecting (2.1s)".
func Waiting() []string {
	var list []*op
	ops.Range(func(k, _ any) bool {
		list = append(list, k.(*op))
		return true
	})
	sort.Slice(list, func(i, j int) bool { return list[i].seq < list[j].seq })
	out := make([]string, len(list))
	for i, o := range list {
		out[i] = fmt.Sprintf("%s (%s)", o.what, round(time.Since(o.start)))
	}
	return out
}
