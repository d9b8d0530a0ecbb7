package app

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// The services' business code runs on either Postgres driver: pgx v5 (a
// *pgxpool.Pool, handlers get a pgx.Tx) or database/sql on lib/pq (a
// *sql.DB, handlers get a *sql.Tx). The little that differs between the
// two is behind db and tx below, one small implementation per driver;
// copy the one your service uses.
//
// With pgx, a business statement and the event it announces go to the
// server in one pgx.Batch (outbox.Writer.AddToBatch): one round trip.

// db is the example's pool, on either driver.
type db interface {
	begin(ctx context.Context) (tx, error)
	exec(ctx context.Context, q string, args ...any) error
	queryRow(ctx context.Context, q string, args ...any) row
	ping(ctx context.Context) error
	// handle is the database for millwright's functions (outbox.ReadStats).
	handle() postgres.DB
}

// tx is a business transaction, on either driver.
type tx interface {
	// exec runs a statement and returns the rows it affected.
	exec(ctx context.Context, q string, args ...any) (int64, error)
	queryRow(ctx context.Context, q string, args ...any) row
	// emit writes the statements, then ev through the outbox with w, in
	// the transaction. An error of any of them is returned by emit.
	emit(ctx context.Context, w *outbox.Writer, ev outbox.Event, stmts ...statement) error
	commit(ctx context.Context) error
	rollback(ctx context.Context) error
	// handle is the transaction for millwright's functions (outbox.Add,
	// saga's Start).
	handle() postgres.Tx
}

// row is *sql.Row or pgx.Row. Both return an error for which
// errors.Is(err, sql.ErrNoRows) holds when no row matched (pgx.ErrNoRows
// wraps sql.ErrNoRows).
type row interface{ Scan(dest ...any) error }

// statement is a business statement queued beside an event (tx.emit).
type statement struct {
	sql  string
	args []any
}

// txFromContext returns the idempotency middleware's transaction of the
// message whose context is ctx, whichever driver its store runs on.
func txFromContext(ctx context.Context) (tx, error) {
	if pt, ok := idempotency.TxFromContext(ctx); ok {
		if pt.Pgx() != nil {
			return pgxTx{pt.Pgx()}, nil
		}
		return sqlTx{pt.SQL()}, nil
	}
	return nil, errors.New("no idempotency transaction in the message context: add the idempotency middleware")
}

// pgx v5.

type pgxDB struct{ pool *pgxpool.Pool }

func (d pgxDB) begin(ctx context.Context) (tx, error) {
	t, err := d.pool.Begin(ctx)
	return pgxTx{t}, err
}

func (d pgxDB) exec(ctx context.Context, q string, args ...any) error {
	_, err := d.pool.Exec(ctx, q, args...)
	return err
}

func (d pgxDB) queryRow(ctx context.Context, q string, args ...any) row {
	return d.pool.QueryRow(ctx, q, args...)
}
func (d pgxDB) ping(ctx context.Context) error { return d.pool.Ping(ctx) }
func (d pgxDB) handle() postgres.DB            { return postgres.Pgx(d.pool) }

type pgxTx struct{ tx pgx.Tx }

func (t pgxTx) exec(ctx context.Context, q string, args ...any) (int64, error) {
	tag, err := t.tx.Exec(ctx, q, args...)
	return tag.RowsAffected(), err
}

func (t pgxTx) queryRow(ctx context.Context, q string, args ...any) row {
	return t.tx.QueryRow(ctx, q, args...)
}

// emit queues the statements and the event's INSERT in one pgx.Batch: one
// round trip. The INSERT's own error comes back from the batch's results.
func (t pgxTx) emit(ctx context.Context, w *outbox.Writer, ev outbox.Event, stmts ...statement) error {
	b := &pgx.Batch{}
	for _, s := range stmts {
		b.Queue(s.sql, s.args...)
	}
	if err := w.AddToBatch(ctx, b, ev); err != nil {
		return err
	}
	if err := t.tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("writing %s with its event: %w", ev.EventType, err)
	}
	return nil
}

func (t pgxTx) commit(ctx context.Context) error   { return t.tx.Commit(ctx) }
func (t pgxTx) rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }
func (t pgxTx) handle() postgres.Tx                { return postgres.PgxTx(t.tx) }

// database/sql (lib/pq).

type sqlDB struct{ db *sql.DB }

func (d sqlDB) begin(ctx context.Context) (tx, error) {
	t, err := d.db.BeginTx(ctx, nil)
	return sqlTx{t}, err
}

func (d sqlDB) exec(ctx context.Context, q string, args ...any) error {
	_, err := d.db.ExecContext(ctx, q, args...)
	return err
}

func (d sqlDB) queryRow(ctx context.Context, q string, args ...any) row {
	return d.db.QueryRowContext(ctx, q, args...)
}
func (d sqlDB) ping(ctx context.Context) error { return d.db.PingContext(ctx) }
func (d sqlDB) handle() postgres.DB            { return postgres.SQL(d.db) }

type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) exec(ctx context.Context, q string, args ...any) (int64, error) {
	res, err := t.tx.ExecContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (t sqlTx) queryRow(ctx context.Context, q string, args ...any) row {
	return t.tx.QueryRowContext(ctx, q, args...)
}

// emit runs the statements, then Writer.Add, which returns its INSERT's
// error itself.
func (t sqlTx) emit(ctx context.Context, w *outbox.Writer, ev outbox.Event, stmts ...statement) error {
	for _, s := range stmts {
		if _, err := t.tx.ExecContext(ctx, s.sql, s.args...); err != nil {
			return err
		}
	}
	return w.Add(ctx, postgres.SQLTx(t.tx), ev)
}

func (t sqlTx) commit(context.Context) error   { return t.tx.Commit() }
func (t sqlTx) rollback(context.Context) error { return t.tx.Rollback() }
func (t sqlTx) handle() postgres.Tx            { return postgres.SQLTx(t.tx) }
