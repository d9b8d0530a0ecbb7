package sagabench

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/transport"
)

// relayTimes records how long the relay's statements and publishes take,
// from a pool and a publisher handed to the relay alone, so that the hop
// "command: written -> participant" can be split into the relay's work
// and its waiting (wake-up, poll).
type relayTimes struct {
	mu      sync.Mutex
	claim   []time.Duration
	mark    []time.Duration
	publish []time.Duration
}

func (r *relayTimes) add(to *[]time.Duration, d time.Duration) {
	r.mu.Lock()
	*to = append(*to, d)
	r.mu.Unlock()
}

// reset forgets what was recorded so far (the warm-up's).
func (r *relayTimes) reset() {
	r.mu.Lock()
	r.claim, r.mark, r.publish = nil, nil, nil
	r.mu.Unlock()
}

// kind sorts a relay statement: its claim (a prepared statement), its
// mark, or anything else (nil: not recorded).
func (r *relayTimes) kind(query string) *[]time.Duration {
	switch {
	case strings.HasPrefix(query, "WITH blocked AS"): // outbox's claimSQL
		return &r.claim
	case strings.Contains(query, "UPDATE millwright_outbox SET status = 'published'"): // the relay's mark
		return &r.mark
	}
	return nil
}

// rows are the relay rows of one run (see Row.Hop).
func (r *relayTimes) rows(run Row) []Row {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Row
	for _, x := range []struct {
		name string
		ds   []time.Duration
	}{{"relay: claim statement", r.claim}, {"relay: publish call", r.publish}, {"relay: mark statement", r.mark}} {
		if len(x.ds) == 0 {
			continue
		}
		ms := stats.Millis(x.ds)
		row := Row{Bench: "saga", Row: RowHop, Kind: run.Kind, Broker: run.Broker, Hop: x.name, Sagas: run.Sagas, Calls: len(ms),
			P50: stats.Percentile(ms, 50), P99: stats.Percentile(ms, 99), Max: stats.Percentile(ms, 100)}
		if row.P50 > 0 {
			row.P99OverP50 = row.P99 / row.P50
		}
		out = append(out, row)
	}
	return out
}

// openTimedDB opens a pool on dsn whose claim and mark statements are
// timed into t.
func openTimedDB(dsn string, t *relayTimes) (*sql.DB, error) {
	c, err := pgconn.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	return sql.OpenDB(timedConnector{c, t}), nil
}

type timedConnector struct {
	driver.Connector
	t *relayTimes
}

func (c timedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &timedConn{Conn: cn, t: c.t}, nil
}

// timedConn passes every call on to the pgconn connection it wraps.
type timedConn struct {
	driver.Conn
	t *relayTimes
}

var (
	_ driver.QueryerContext     = (*timedConn)(nil)
	_ driver.ExecerContext      = (*timedConn)(nil)
	_ driver.ConnPrepareContext = (*timedConn)(nil)
	_ driver.ConnBeginTx        = (*timedConn)(nil)
	_ driver.SessionResetter    = (*timedConn)(nil)
	_ driver.Validator          = (*timedConn)(nil)
	_ driver.NamedValueChecker  = (*timedConn)(nil)
)

func (c *timedConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	start := time.Now()
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
	if to := c.t.kind(q); to != nil && err == nil {
		return &timedRows{Rows: rows, done: func() { c.t.add(to, time.Since(start)) }}, nil
	}
	return rows, err
}

func (c *timedConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	start := time.Now()
	res, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
	if to := c.t.kind(q); to != nil && err == nil {
		c.t.add(to, time.Since(start))
	}
	return res, err
}

func (c *timedConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	if to := c.t.kind(q); to != nil {
		return &timedStmt{Stmt: st, t: c.t, to: to}, nil
	}
	return st, nil
}

func (c *timedConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *timedConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *timedConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c *timedConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

// timedStmt times its queries until their rows are closed: the claim is
// an UPDATE ... RETURNING, done when its rows are read.
type timedStmt struct {
	driver.Stmt
	t  *relayTimes
	to *[]time.Duration
}

func (s *timedStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	start := time.Now()
	rows, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err != nil {
		return nil, err
	}
	return &timedRows{Rows: rows, done: func() { s.t.add(s.to, time.Since(start)) }}, nil
}

func (s *timedStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	return s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

type timedRows struct {
	driver.Rows
	once sync.Once
	done func()
}

func (r *timedRows) Close() error {
	r.once.Do(r.done)
	return r.Rows.Close()
}

// timedPublisher times the relay's publishes.
type timedPublisher struct {
	message.Publisher
	t *relayTimes
}

func (p timedPublisher) Publish(topic string, msgs ...*message.Message) error {
	start := time.Now()
	err := p.Publisher.Publish(topic, msgs...)
	p.t.add(&p.t.publish, time.Since(start))
	return err
}

// timedBatchPublisher is a timedPublisher of a publisher that has
// PublishBatch, which the relay prefers.
type timedBatchPublisher struct {
	timedPublisher
	b transport.BatchPublisher
}

var _ transport.BatchPublisher = timedBatchPublisher{}

func (p timedBatchPublisher) PublishBatch(topic string, msgs ...*message.Message) error {
	start := time.Now()
	err := p.b.PublishBatch(topic, msgs...)
	p.t.add(&p.t.publish, time.Since(start))
	return err
}

// timed wraps pub for the relay, keeping PublishBatch when it has it.
// (The sql kind's publisher is not wrapped: the relay publishes in the
// database through it.)
func (r *relayTimes) timed(pub message.Publisher) message.Publisher {
	tp := timedPublisher{Publisher: pub, t: r}
	if b, ok := pub.(transport.BatchPublisher); ok {
		return timedBatchPublisher{timedPublisher: tp, b: b}
	}
	return tp
}
