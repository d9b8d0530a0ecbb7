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
//   - NewListener's connections are closed when its context ends.
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
	u.RawQuery = q.Encode()
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

// NewConnector returns the connector Open uses, for sql.OpenDB.
func NewConnector(dsn string) (driver.Connector, error) {
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
	cfg  pq.Config
	addr string
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
	return &conn{Conn: cn, nc: nc, addr: c.addr}, nil
}

// connectError says what went wrong with a connection attempt to addr.
func connectError(ctx context.Context, addr string, timeout time.Duration, accepted bool, elapsed time.Duration, err error) error {
	if ctx.Err() != nil {
		cause := context.Cause(ctx)
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
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
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
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, network, address)
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

// conn is a lib/pq connection whose context-taking calls give up when
// their context ends (see guard).
type conn struct {
	driver.Conn
	nc      net.Conn
	addr    string
	mu      sync.Mutex
	aborted bool
}

var (
	_ driver.ConnBeginTx        = (*conn)(nil)
	_ driver.ConnPrepareContext = (*conn)(nil)
	_ driver.QueryerContext     = (*conn)(nil)
	_ driver.ExecerContext      = (*conn)(nil)
	_ driver.Pinger             = (*conn)(nil)
	_ driver.SessionResetter    = (*conn)(nil)
	_ driver.Validator          = (*conn)(nil)
	_ driver.NamedValueChecker  = (*conn)(nil)
)

// guard closes the connection if ctx ends before the call it wraps
// returns: lib/pq then only sends a cancel request and keeps reading, and
// a silent server never answers either. The returned function ends the
// guard and turns the call's error into one that says so.
func (c *conn) guard(ctx context.Context, what string) func(error) error {
	if ctx.Done() == nil || c.nc == nil {
		return func(err error) error { return err }
	}
	start := time.Now()
	done := track("postgres at " + c.addr + ": " + what)
	stop := context.AfterFunc(ctx, func() {
		c.mu.Lock()
		c.aborted = true
		c.mu.Unlock()
		_ = c.nc.Close()
	})
	return func(err error) error {
		done()
		if stop() || err == nil {
			return err
		}
		// Not wrapping err: lib/pq reports the closed socket as
		// driver.ErrBadConn, which database/sql would retry on a new
		// connection, only to return the bare context error.
		cause := context.Cause(ctx)
		if errors.Is(cause, context.DeadlineExceeded) {
			return fmt.Errorf("postgres at %s did not complete %s within %s: %w", c.addr, what, round(time.Since(start)), cause)
		}
		return fmt.Errorf("interrupted while waiting for postgres at %s to answer %s (after %s): %w", c.addr, what, round(time.Since(start)), cause)
	}
}

func (c *conn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	end := c.guard(ctx, "a query")
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	return rows, end(err)
}

func (c *conn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	end := c.guard(ctx, "a statement")
	res, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	return res, end(err)
}

func (c *conn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	end := c.guard(ctx, "a prepare")
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	return st, end(err)
}

func (c *conn) Ping(ctx context.Context) error {
	end := c.guard(ctx, "a ping")
	return end(c.Conn.(driver.Pinger).Ping(ctx))
}

func (c *conn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if first, ok := ctx.Value(firstKey{}).(*FirstStatement); ok && first != nil && !first.Sent {
		return c.beginWith(ctx, opts, first)
	}
	end := c.guard(ctx, "BEGIN")
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err = end(err); err != nil {
		return nil, err
	}
	return &txn{Tx: tx, c: c, ctx: ctx}, nil
}

func (c *conn) ResetSession(ctx context.Context) error {
	if !c.IsValid() {
		return driver.ErrBadConn
	}
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

// IsValid reports false once a guard closed the connection, so the pool
// drops it.
func (c *conn) IsValid() bool {
	c.mu.Lock()
	aborted := c.aborted
	c.mu.Unlock()
	return !aborted && c.Conn.(driver.Validator).IsValid()
}

func (c *conn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

// txn commits under the guard of the context the transaction began with
// (database/sql's Commit takes none). Rollback is not guarded: database/sql
// runs it itself when that context ends, and the guard has then closed the
// connection already.
type txn struct {
	driver.Tx
	c   *conn
	ctx context.Context
}

func (t *txn) Commit() error {
	end := t.c.guard(t.ctx, "COMMIT")
	return end(t.Tx.Commit())
}

// FirstStatement is a statement sent with BEGIN in one round trip by a
// transaction begun on a pool of Open (see WithFirstStatement). lib/pq
// sends BEGIN alone, so a statement every transaction of some kind starts
// with (the idempotency mark) costs a round trip of its own otherwise.
type FirstStatement struct {
	// SQL is the statement: no parameters ($n), values inlined as quoted
	// literals; several statements separated by ';' are allowed.
	SQL string
	// Sent reports whether BEGIN carried SQL. It stays false when the pool
	// is not one of Open (the caller then runs SQL in the transaction
	// itself) and when BEGIN failed.
	Sent bool
	// RowsAffected is the row count of SQL's last statement, once Sent.
	RowsAffected int64
}

type firstKey struct{}

// WithFirstStatement returns ctx asking BeginTx of a pool of Open to send
// first with BEGIN, in one round trip, as the transaction's first
// statement. An error of first's statement is BeginTx's error (a
// *pq.Error), and no transaction is left open. Other pools ignore it.
func WithFirstStatement(ctx context.Context, first *FirstStatement) context.Context {
	return context.WithValue(ctx, firstKey{}, first)
}

// beginWith begins a transaction with first's statement in the same simple
// query. lib/pq takes the connection's transaction state from the
// server's ReadyForQuery, so after the query it knows the connection is in
// a transaction; the transaction is then driven with simple queries of
// this package's own (pipelinedTx), not with lib/pq's Commit and Rollback,
// which expect a transaction that lib/pq's BeginTx began.
func (c *conn) beginWith(ctx context.Context, opts driver.TxOptions, first *FirstStatement) (driver.Tx, error) {
	mode, err := beginMode(opts)
	if err != nil {
		return nil, err
	}
	ex := c.Conn.(driver.ExecerContext)
	end := c.guard(ctx, "BEGIN")
	res, err := ex.ExecContext(ctx, "BEGIN"+mode+"; "+first.SQL, nil)
	if err = end(err); err != nil {
		// The statement failed inside the transaction block BEGIN opened
		// (or BEGIN itself failed): end it, so the connection goes back
		// to the pool outside a transaction.
		if _, rerr := ex.ExecContext(context.WithoutCancel(ctx), "ROLLBACK", nil); rerr != nil {
			c.markBad()
		}
		return nil, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		n = 0
	}
	first.Sent, first.RowsAffected = true, n
	return &pipelinedTx{c: c, ctx: ctx}, nil
}

// beginMode is the BEGIN options lib/pq's BeginTx sends for opts.
func beginMode(opts driver.TxOptions) (string, error) {
	var mode string
	switch sql.IsolationLevel(opts.Isolation) {
	case sql.LevelDefault:
	case sql.LevelReadUncommitted:
		mode = " ISOLATION LEVEL READ UNCOMMITTED"
	case sql.LevelReadCommitted:
		mode = " ISOLATION LEVEL READ COMMITTED"
	case sql.LevelRepeatableRead:
		mode = " ISOLATION LEVEL REPEATABLE READ"
	case sql.LevelSerializable:
		mode = " ISOLATION LEVEL SERIALIZABLE"
	default:
		return "", fmt.Errorf("pq: isolation level not supported: %d", opts.Isolation)
	}
	if opts.ReadOnly {
		return mode + " READ ONLY", nil
	}
	return mode + " READ WRITE", nil
}

// markBad makes the pool drop the connection.
func (c *conn) markBad() {
	c.mu.Lock()
	c.aborted = true
	c.mu.Unlock()
}

// ErrTxAborted is Commit's error for a transaction begun with a
// FirstStatement in which a statement had failed: the server rolled it
// back (as lib/pq's pq.ErrInFailedTransaction for its own transactions).
var ErrTxAborted = errors.New("pq: could not complete operation in a failed transaction: rolled back")

// pipelinedTx is a transaction begun by beginWith. Commit sends COMMIT as
// a simple query and reads its command tag: in a transaction where a
// statement failed, the server answers COMMIT by rolling back with the tag
// ROLLBACK and no error, which lib/pq's own Commit catches from its
// transaction state, and this one from the tag.
type pipelinedTx struct {
	c    *conn
	ctx  context.Context
	done bool
}

var _ driver.Tx = (*pipelinedTx)(nil)

// tagged is lib/pq's rows: Tag is the command tag of the statement.
type tagged interface{ Tag() string }

func (t *pipelinedTx) Commit() error {
	if t.done {
		return errors.New("pgconn: transaction already ended")
	}
	t.done = true
	end := t.c.guard(t.ctx, "COMMIT")
	rows, err := t.c.Conn.(driver.QueryerContext).QueryContext(context.WithoutCancel(t.ctx), "COMMIT", nil)
	if err = end(err); err != nil {
		// COMMIT failed (it ends the transaction either way: a deferred
		// constraint, a serialization failure), or the connection did.
		var pqErr *pq.Error
		if !errors.As(err, &pqErr) {
			t.c.markBad()
		}
		return err
	}
	tag := ""
	if tg, ok := rows.(tagged); ok {
		tag = tg.Tag()
	}
	_ = rows.Close()
	switch tag {
	case "COMMIT":
		return nil
	case "ROLLBACK":
		return ErrTxAborted
	}
	t.c.markBad()
	return fmt.Errorf("pgconn: COMMIT answered with command tag %q", tag)
}

func (t *pipelinedTx) Rollback() error {
	if t.done {
		return nil
	}
	t.done = true
	// database/sql rolls back itself when the transaction's context ends:
	// the statement must not depend on that context.
	if _, err := t.c.Conn.(driver.ExecerContext).ExecContext(context.Background(), "ROLLBACK", nil); err != nil {
		t.c.markBad()
		return err
	}
	return nil
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
