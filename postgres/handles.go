package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/txhook"
)

// DB is a database millwright's components run on: a *pgxpool.Pool or a
// *sql.DB, whichever the service has. Every constructor takes one, so a
// service that picks its driver at run time builds its components once:
//
//	db := postgres.From(pool) // *pgxpool.Pool or *sql.DB
//	r, err := relay.New(db, pub, relay.Config{}) // package outbox/relay
//
// The zero DB holds no pool; components refuse it with ErrNoDB. A DB is a
// small value: copy it freely; it is safe for concurrent use when its pool
// is (both drivers' pools are).
type DB struct {
	sql *sql.DB
	pgx *pgxpool.Pool
}

// Tx is a transaction of the service's own, on either driver. The writes
// that must commit or roll back with the business rows (outbox.Add,
// saga.Start, dlq.ResolveTx, ...) take a Tx, never a DB: a program that
// passes a pool where a transaction is required does not compile.
//
// A Tx does not own the transaction: the service commits or rolls it back
// through the *sql.Tx or pgx.Tx it wrapped. Not safe for concurrent use
// (neither driver's transaction is).
type Tx struct {
	sql *sql.Tx
	pgx pgx.Tx
	// internal is a statement queue or transaction of millwright's own
	// (internal/txhook): never set from outside the module.
	internal any
}

func init() {
	txhook.Wrap = func(q any) any { return Tx{internal: q} }
	txhook.Unwrap = func(tx any) any {
		if t, ok := tx.(Tx); ok {
			return t.internal
		}
		return nil
	}
}

// ErrNoDB is returned (wrapped) by the components given a zero DB or Tx,
// or one built from a nil pool or transaction.
var ErrNoDB = errors.New("postgres: no database handle")

// From returns the DB of a *pgxpool.Pool or a *sql.DB. Generic code over
// Pool calls it once; a service that knows its driver may call Pgx or SQL.
func From[P Pool](p P) DB {
	switch h := any(p).(type) {
	case *sql.DB:
		return SQL(h)
	case *pgxpool.Pool:
		return Pgx(h)
	}
	return DB{}
}

// Pgx returns the DB of a pgx pool.
func Pgx(pool *pgxpool.Pool) DB { return DB{pgx: pool} }

// SQL returns the DB of a database/sql pool (lib/pq, or pgx's stdlib
// adapter).
func SQL(db *sql.DB) DB { return DB{sql: db} }

// PgxTx returns the Tx of a pgx transaction.
func PgxTx(tx pgx.Tx) Tx { return Tx{pgx: tx} }

// SQLTx returns the Tx of a database/sql transaction.
func SQLTx(tx *sql.Tx) Tx { return Tx{sql: tx} }

// SQL returns the *sql.DB the DB wraps, or nil when it wraps a pgx pool.
func (d DB) SQL() *sql.DB { return d.sql }

// Pgx returns the *pgxpool.Pool the DB wraps, or nil when it wraps a
// *sql.DB.
func (d DB) Pgx() *pgxpool.Pool { return d.pgx }

// Valid reports whether d holds a pool; ErrNoDB otherwise, naming the fix.
func (d DB) Valid() error {
	if d.sql == nil && d.pgx == nil {
		return fmt.Errorf("%w: the DB is zero or built from a nil pool: build it with postgres.From(pool), postgres.Pgx(pool) or postgres.SQL(db) on an open pool", ErrNoDB)
	}
	return nil
}

// Driver names the driver: "pgx", "database/sql", or "" for the zero DB.
func (d DB) Driver() string {
	switch {
	case d.pgx != nil:
		return "pgx"
	case d.sql != nil:
		return "database/sql"
	}
	return ""
}

// PingContext checks that the database answers, on either driver: a DB
// is a health.Pinger.
func (d DB) PingContext(ctx context.Context) error {
	switch {
	case d.pgx != nil:
		return d.pgx.Ping(ctx)
	case d.sql != nil:
		return d.sql.PingContext(ctx)
	}
	return d.Valid()
}

// InTx runs fn in a transaction of d, committed when fn returns nil and
// rolled back otherwise (also when fn panics; the panic goes on).
func (d DB) InTx(ctx context.Context, fn func(Tx) error) (err error) {
	if err := d.Valid(); err != nil {
		return err
	}
	if d.pgx != nil {
		tx, err := d.pgx.Begin(ctx)
		if err != nil {
			return err
		}
		committed := false
		defer func() {
			if !committed {
				_ = tx.Rollback(context.WithoutCancel(ctx))
			}
		}()
		if err := fn(PgxTx(tx)); err != nil {
			return err
		}
		committed = true
		return tx.Commit(ctx)
	}
	tx, err := d.sql.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if err := fn(SQLTx(tx)); err != nil {
		return err
	}
	committed = true
	return tx.Commit()
}

// SQL returns the *sql.Tx the Tx wraps, or nil when it wraps a pgx.Tx.
func (t Tx) SQL() *sql.Tx { return t.sql }

// Pgx returns the pgx.Tx the Tx wraps, or nil when it wraps a *sql.Tx.
func (t Tx) Pgx() pgx.Tx { return t.pgx }

// Valid reports whether t holds a transaction; ErrNoDB otherwise, naming
// the fix.
func (t Tx) Valid() error {
	if t.sql == nil && t.pgx == nil && t.internal == nil {
		return fmt.Errorf("%w: the Tx is zero or built from a nil transaction: build it with postgres.PgxTx(tx) or postgres.SQLTx(tx) on the open business transaction", ErrNoDB)
	}
	return nil
}

// Handle is a DB or a Tx: what millwright's reads take (outbox.ReadStats,
// saga.List, ...), so that they run in the caller's transaction when it
// has one. Writes never take a Handle: they take a Tx, or a DB when
// their name says they run in a transaction of their own. Only DB and Tx
// implement Handle.
type Handle interface {
	// Valid reports whether the handle holds a pool or a transaction.
	Valid() error
	handle()
}

func (DB) handle() {}
func (Tx) handle() {}
