package pgconn

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/lib/pq"
)

// conn is a lib/pq connection whose context-taking calls give up when
// their context ends (see guard) and whose transactions this package
// drives itself (see tx).
//
// database/sql uses a connection from one goroutine at a time: only
// aborted, which a guard sets from another goroutine, needs mu.
type conn struct {
	driver.Conn
	nc   net.Conn
	addr string

	tx *tx // the transaction open on the connection, nil outside one

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
	if err = end(err); err != nil {
		return nil, err
	}
	return st, nil
}

func (c *conn) Ping(ctx context.Context) error {
	end := c.guard(ctx, "a ping")
	return end(c.Conn.(driver.Pinger).Ping(ctx))
}

func (c *conn) ResetSession(ctx context.Context) error {
	if !c.IsValid() {
		return driver.ErrBadConn
	}
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

// IsValid reports false once a guard closed the connection, or a
// transaction could not be ended, so the pool drops it.
func (c *conn) IsValid() bool {
	c.mu.Lock()
	aborted := c.aborted
	c.mu.Unlock()
	return !aborted && c.Conn.(driver.Validator).IsValid()
}

func (c *conn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

// markBad makes the pool drop the connection.
func (c *conn) markBad() {
	c.mu.Lock()
	c.aborted = true
	c.mu.Unlock()
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

func (c *conn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if c.tx != nil {
		return nil, errors.New("pgconn: a transaction is already open on this connection")
	}
	mode, err := beginMode(opts)
	if err != nil {
		return nil, err
	}
	first, _ := ctx.Value(firstKey{}).(*FirstStatement)
	if first != nil && first.Sent {
		first = nil
	}
	query := "BEGIN" + mode
	if first != nil {
		query += "; " + first.SQL
	}
	ex := c.Conn.(driver.ExecerContext)
	end := c.guard(ctx, "BEGIN")
	res, err := ex.ExecContext(ctx, query, nil)
	if err = end(err); err != nil {
		// The first statement failed inside the transaction block BEGIN
		// opened (or BEGIN itself failed): end it, so the connection goes
		// back to the pool outside a transaction.
		if _, rerr := ex.ExecContext(context.WithoutCancel(ctx), "ROLLBACK", nil); rerr != nil {
			c.markBad()
		}
		return nil, err
	}
	if first != nil {
		n, err := res.RowsAffected()
		if err != nil {
			n = 0
		}
		first.Sent, first.RowsAffected = true, n
	}
	c.tx = &tx{c: c, ctx: ctx}
	return c.tx, nil
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

// ErrTxAborted is Commit's error for a transaction in which a statement had
// failed: the server rolled it back. It is lib/pq's own error for the same
// case, so code written against lib/pq's transactions keeps recognising it.
var ErrTxAborted = pq.ErrInFailedTransaction

// tx is a transaction of conn, begun, committed and rolled back with simple
// queries of this package's own rather than lib/pq's BeginTx, so that BEGIN
// can carry a first statement in one round trip. lib/pq takes the connection's transaction state from the
// server's ReadyForQuery, so its statements inside work as in its own
// transactions.
//
// Commit sends COMMIT as a simple query and reads its command tag: in a
// transaction where a statement failed, the server answers COMMIT by
// rolling back with the tag ROLLBACK and no error, which lib/pq's own
// Commit catches from its transaction state, and this one from the tag.
// Commit and Rollback are guarded by the context the transaction began
// with (database/sql's take none).
type tx struct {
	c    *conn
	ctx  context.Context
	done bool
}

var _ driver.Tx = (*tx)(nil)

// tagged is lib/pq's rows: Tag is the command tag of the last statement.
type tagged interface{ Tag() string }

// end marks the transaction ended on its connection.
func (t *tx) end() {
	t.done = true
	if t.c.tx == t {
		t.c.tx = nil
	}
}

func (t *tx) Commit() error {
	if t.done {
		return errors.New("pgconn: transaction already ended")
	}
	t.end()
	c := t.c
	end := c.guard(t.ctx, "COMMIT")
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(context.WithoutCancel(t.ctx), "COMMIT", nil)
	if err == nil {
		err = rows.Close()
	}
	if err = end(err); err != nil {
		var pqErr *pq.Error
		if !errors.As(err, &pqErr) {
			c.markBad() // the connection failed: its state is unknown
		}
		// Otherwise COMMIT itself failed (a deferred constraint, a
		// serialization failure): it ended the transaction.
		return err
	}
	tag := ""
	if tg, ok := rows.(tagged); ok {
		tag = tg.Tag()
	}
	switch tag {
	case "COMMIT":
		return nil
	case "ROLLBACK":
		return ErrTxAborted
	}
	c.markBad()
	return fmt.Errorf("pgconn: COMMIT answered with command tag %q", tag)
}

func (t *tx) Rollback() error {
	if t.done {
		return nil
	}
	t.end()
	// database/sql rolls back itself when the transaction's context ends:
	// the statement must not depend on that context.
	if _, err := t.c.Conn.(driver.ExecerContext).ExecContext(context.Background(), "ROLLBACK", nil); err != nil {
		t.c.markBad()
		return err
	}
	return nil
}
