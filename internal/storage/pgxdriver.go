package storage

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PgxExecutor is what the pgx driver runs statements on: a pgx.Tx, a
// *pgx.Conn, a *pgxpool.Pool or *pgxpool.Conn, or a user's wrapper of one.
type PgxExecutor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// NewPgx returns the pgx driver's Querier on e.
func NewPgx(e PgxExecutor) Querier { return pgxQuerier{e} }

// NewPgxPool returns the pgx driver's Pool on p.
func NewPgxPool(p *pgxpool.Pool) Pool { return pgxPool{pgxQuerier{p}, p} }

type pgxQuerier struct{ e PgxExecutor }

func (pgxQuerier) Driver() Driver { return DriverPgx }

func (q pgxQuerier) Exec(ctx context.Context, s Statement) (int64, error) {
	if err := checkArgs(s); err != nil {
		return 0, err
	}
	tag, err := q.e.Exec(ctx, withExpect(s, 0), s.Args...)
	if err != nil {
		return 0, conflictOf(err, []Statement{s})
	}
	if s.Expect >= 0 {
		return s.Expect, nil
	}
	return tag.RowsAffected(), nil
}

func (q pgxQuerier) Query(ctx context.Context, s Statement, scan func(Row) error) error {
	if err := checkArgs(s); err != nil {
		return err
	}
	rows, err := q.e.Query(ctx, withExpect(s, 0), s.Args...)
	if err != nil {
		return conflictOf(err, []Statement{s})
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(pgxRow{rows}); err != nil {
			return err
		}
	}
	rows.Close()
	return conflictOf(rows.Err(), []Statement{s})
}

func (q pgxQuerier) QueryRow(ctx context.Context, s Statement, dest ...any) error {
	return firstRow(ctx, q, s, dest)
}

func (q pgxQuerier) Batch(ctx context.Context, ss ...Statement) error {
	switch len(ss) {
	case 0:
		return nil
	case 1:
		if _, err := q.Exec(ctx, ss[0]); err != nil {
			return &BatchError{Index: 0, Count: 1, What: ss[0].What, Err: err}
		}
		return nil
	}
	for i, s := range ss {
		if err := checkArgs(s); err != nil {
			return &BatchError{Index: i, Count: len(ss), What: s.What, Err: err}
		}
	}
	b := &pgx.Batch{}
	for i, s := range ss {
		b.Queue(withExpect(s, i), s.Args...)
	}
	br := q.e.SendBatch(ctx, b)
	for i := range ss {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return &BatchError{Index: i, Count: len(ss), What: ss[i].What, Err: conflictOf(err, ss)}
		}
	}
	return br.Close()
}

// pgxRow translates Array destinations (pgx scans arrays natively).
type pgxRow struct{ rows pgx.Rows }

func (r pgxRow) Scan(dest ...any) error {
	for i, d := range dest {
		if a, ok := d.(arrayDest); ok {
			dest[i] = a.p
		}
	}
	return r.rows.Scan(dest...)
}

type pgxPool struct {
	pgxQuerier
	p *pgxpool.Pool
}

func (p pgxPool) Handle() any { return p.p }

func (p pgxPool) Begin(ctx context.Context, opts TxOptions) (Tx, error) {
	begin := "begin isolation level "
	switch opts.Isolation {
	case ReadCommitted:
		begin += "read committed"
	case RepeatableRead:
		begin += "repeatable read"
	case Serializable:
		begin += "serializable"
	default:
		return nil, fmt.Errorf("storage: unknown isolation level %d", opts.Isolation)
	}
	if opts.ReadOnly {
		begin += " read only"
	} else {
		begin += " read write"
	}
	if len(opts.First) > 0 {
		// pgx sends a statement without arguments as a simple query:
		// BEGIN and the first statements, inlined, go in one round trip.
		text, err := inlineAll(opts.First)
		if err != nil {
			return nil, err
		}
		begin = begin + ";\n" + text
	}
	conn, err := p.p.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
	if err != nil {
		// A first statement failed inside the block BEGIN opened: end it,
		// so the connection goes back to the pool idle (pgxpool destroys
		// a connection released inside a transaction).
		if c := conn.Conn(); !c.IsClosed() && c.PgConn().TxStatus() != 'I' {
			_, _ = c.Exec(context.WithoutCancel(ctx), "rollback")
		}
		conn.Release()
		return nil, conflictOf(err, opts.First)
	}
	return &pgxTx{pgxQuerier: pgxQuerier{tx}, tx: tx, conn: conn}, nil
}

type pgxTx struct {
	pgxQuerier
	tx   pgx.Tx
	conn *pgxpool.Conn
}

func (t *pgxTx) Handle() any { return t.tx }

func (t *pgxTx) release() {
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}

func (t *pgxTx) Commit(ctx context.Context) error {
	defer t.release()
	return t.tx.Commit(ctx)
}

func (t *pgxTx) Rollback(ctx context.Context) error {
	defer t.release()
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}
