package saga

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/outbox"
)

// The statements on a saga's path (Start, a reply's transition) carry
// their values as quoted literals instead of $n parameters: lib/pq sends a
// statement without parameters as one simple query, one round trip, where
// a parameterised one takes two (parse, then bind and execute). The outbox
// and the idempotency store do the same. pq.QuoteLiteral is libpq's
// escaping; every text value is storable (no NUL byte) by the time it
// gets here.

func litText(s string) string { return pq.QuoteLiteral(s) }

func litNullText(s sql.NullString) string {
	if !s.Valid {
		return "NULL"
	}
	return litText(s.String)
}

func litInt(n int64) string { return strconv.FormatInt(n, 10) }

func litNullInt(n sql.NullInt64) string {
	if !n.Valid {
		return "NULL"
	}
	return litInt(n.Int64)
}

func litBool(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// litTime keeps the nanoseconds lib/pq would send; Postgres rounds them to
// microseconds either way.
func litTime(t time.Time) string {
	return "'" + t.Format("2006-01-02 15:04:05.999999999Z07:00") + "'::timestamptz"
}

func litNullTime(t sql.NullTime) string {
	if !t.Valid {
		return "NULL"
	}
	return litTime(t.Time)
}

// litArray renders n elements, each rendered by elem, as an array of
// type typ.
func litArray(n int, typ string, elem func(i int) string) string {
	if n == 0 {
		return "'{}'::" + typ
	}
	var b strings.Builder
	b.WriteString("ARRAY[")
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(elem(i))
	}
	b.WriteString("]::")
	b.WriteString(typ)
	return b.String()
}

// histInsert is the INSERT of t's history rows, in order, for the saga
// ids that src (a CTE or table with an id column) yields.
func histInsert(src string, t *transition) string {
	h := t.hist
	n := len(h)
	return `INSERT INTO millwright_saga_steps (saga_id, step, kind, detail, attempt, error)
		SELECT x.id, u.s, u.k, u.d, u.a, u.e
		FROM ` + src + ` x, unnest(` +
		litArray(n, "text[]", func(i int) string { return litText(h[i].step) }) + `, ` +
		litArray(n, "text[]", func(i int) string { return litText(h[i].kind) }) + `, ` +
		litArray(n, "text[]", func(i int) string { return litText(h[i].detail) }) + `, ` +
		litArray(n, "int[]", func(i int) string { return litInt(int64(h[i].attempt)) }) + `, ` +
		litArray(n, "text[]", func(i int) string {
			if h[i].err == "" {
				return "NULL"
			}
			return litText(h[i].err)
		}) + `)
			WITH ORDINALITY AS u(s, k, d, a, e, o)
		ORDER BY u.o`
}

// outboxStatement returns the statement outbox.Add would execute for
// events, so that a transition sends it in the round trip of its own
// statement. ok is false when Add would not run exactly one statement
// without parameters (then call outbox.Add itself); err is Add's refusal
// of an event.
func outboxStatement(ctx context.Context, events []outbox.Event) (stmt string, ok bool, err error) {
	var c captureExec
	if err := outbox.Add(ctx, &c, events...); err != nil {
		if errors.Is(err, errNotCaptured) {
			return "", false, nil
		}
		return "", false, err
	}
	if len(c.stmts) != 1 || c.args {
		return "", false, nil
	}
	return c.stmts[0], true, nil
}

// captureExec is an outbox.Executor that records the statements it is
// given instead of running them.
type captureExec struct {
	stmts []string
	args  bool
}

var _ outbox.Executor = (*captureExec)(nil)

func (c *captureExec) ExecContext(_ context.Context, q string, args ...any) (sql.Result, error) {
	c.stmts = append(c.stmts, q)
	c.args = c.args || len(args) > 0
	return captured{}, nil
}

func (c *captureExec) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	c.args = true // not capturable: make the caller run Add itself
	return nil, errNotCaptured
}

type captured struct{}

func (captured) LastInsertId() (int64, error) { return 0, errNotCaptured }
func (captured) RowsAffected() (int64, error) { return 0, errNotCaptured }

var errNotCaptured = errors.New("saga: statement captured, not executed")
