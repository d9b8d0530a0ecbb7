package storage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/pgconn"
)

// SQLExecutor is what the database/sql driver runs statements on: a
// *sql.DB, *sql.Tx or *sql.Conn, or a user's wrapper of one.
type SQLExecutor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// NewSQL returns the database/sql driver's Querier on e.
func NewSQL(e SQLExecutor) Querier { return sqlQuerier{e} }

// NewSQLPool returns the database/sql driver's Pool on db.
func NewSQLPool(db *sql.DB) Pool { return sqlPool{sqlQuerier{db}, db} }

type sqlQuerier struct{ e SQLExecutor }

func (sqlQuerier) Driver() Driver { return DriverSQL }

func (q sqlQuerier) Exec(ctx context.Context, s Statement) (int64, error) {
	text, err := inline(s, 0)
	if err != nil {
		return 0, err
	}
	res, err := q.e.ExecContext(ctx, text)
	if err != nil {
		return 0, conflictOf(err, []Statement{s})
	}
	if s.Expect >= 0 {
		return s.Expect, nil
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("storage: reading the row count: %w", err)
	}
	return n, nil
}

func (q sqlQuerier) Query(ctx context.Context, s Statement, scan func(Row) error) error {
	text, err := inline(s, 0)
	if err != nil {
		return err
	}
	rows, err := q.e.QueryContext(ctx, text)
	if err != nil {
		return conflictOf(err, []Statement{s})
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(sqlRow{rows}); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return conflictOf(err, []Statement{s})
	}
	return rows.Close()
}

func (q sqlQuerier) QueryRow(ctx context.Context, s Statement, dest ...any) error {
	return firstRow(ctx, q, s, dest)
}

func (q sqlQuerier) Batch(ctx context.Context, ss ...Statement) error {
	if len(ss) == 0 {
		return nil
	}
	text, err := inlineAll(ss)
	if err != nil {
		return err
	}
	if _, err := q.e.ExecContext(ctx, text); err != nil {
		err = conflictOf(err, ss)
		var ce *ConflictError
		if errors.As(err, &ce) {
			return &BatchError{Index: ce.Index, Count: len(ss), What: ce.What, Err: err}
		}
		// One simple query: the server does not say which statement failed.
		return &BatchError{Index: -1, Count: len(ss), What: whats(ss), Err: err}
	}
	return nil
}

// sqlRow translates Array destinations for lib/pq.
type sqlRow struct{ rows *sql.Rows }

func (r sqlRow) Scan(dest ...any) error {
	for i, d := range dest {
		if a, ok := d.(arrayDest); ok {
			dest[i] = pq.Array(a.p)
		}
	}
	return r.rows.Scan(dest...)
}

type sqlPool struct {
	sqlQuerier
	db *sql.DB
}

func (p sqlPool) Handle() any { return p.db }

func (p sqlPool) Begin(ctx context.Context, opts TxOptions) (Tx, error) {
	o := &sql.TxOptions{ReadOnly: opts.ReadOnly}
	switch opts.Isolation {
	case ReadCommitted:
		o.Isolation = sql.LevelReadCommitted
	case RepeatableRead:
		o.Isolation = sql.LevelRepeatableRead
	case Serializable:
		o.Isolation = sql.LevelSerializable
	default:
		return nil, fmt.Errorf("storage: unknown isolation level %d", opts.Isolation)
	}
	var first *pgconn.FirstStatement
	if len(opts.First) > 0 {
		text, err := inlineAll(opts.First)
		if err != nil {
			return nil, err
		}
		first = &pgconn.FirstStatement{SQL: text}
		ctx = pgconn.WithFirstStatement(ctx, first)
	}
	tx, err := p.db.BeginTx(ctx, o)
	if err != nil {
		return nil, conflictOf(err, opts.First)
	}
	if first != nil && !first.Sent {
		// Not a pool of pgconn.Open: BEGIN went alone.
		if _, err := tx.ExecContext(ctx, first.SQL); err != nil {
			_ = tx.Rollback()
			return nil, conflictOf(err, opts.First)
		}
	}
	return &sqlTx{sqlQuerier{tx}, tx}, nil
}

type sqlTx struct {
	sqlQuerier
	tx *sql.Tx
}

func (t *sqlTx) Handle() any { return t.tx }

func (t *sqlTx) Commit(context.Context) error { return t.tx.Commit() }

func (t *sqlTx) Rollback(context.Context) error {
	if err := t.tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return nil
}
