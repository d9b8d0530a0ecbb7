package storage

import (
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/txhook"
	"github.com/millwright/millwright/postgres"
)

// ErrUnsupported is returned (wrapped) by From and PoolFrom for a value
// that is neither driver's.
var ErrUnsupported = errors.New("storage: unsupported database handle")

// From returns the Querier for a user's executor: a *sql.Tx, *sql.DB,
// *sql.Conn (or anything with database/sql's ExecContext and
// QueryContext), or a pgx.Tx, *pgx.Conn, *pgxpool.Pool, *pgxpool.Conn (or
// anything with pgx's Exec, Query and SendBatch). A Querier is returned
// as it is.
func From(x any) (Querier, error) {
	switch e := x.(type) {
	case nil:
		return nil, fmt.Errorf("%w: nil: pass the transaction (*sql.Tx or pgx.Tx)", ErrUnsupported)
	case Querier:
		return e, nil
	case Tx:
		return e, nil
	case postgres.DB:
		return FromDB(e)
	case postgres.Tx:
		return FromTx(e)
	case PgxExecutor:
		return NewPgx(e), nil
	case SQLExecutor:
		return NewSQL(e), nil
	}
	return nil, fmt.Errorf("%w: %T is neither a database/sql executor (*sql.Tx, *sql.DB, *sql.Conn) nor a pgx one (pgx.Tx, *pgx.Conn, *pgxpool.Pool)", ErrUnsupported, x)
}

// PoolFrom returns the Pool for a *sql.DB or a *pgxpool.Pool.
func PoolFrom(x any) (Pool, error) {
	switch p := x.(type) {
	case *sql.DB:
		if p == nil {
			break
		}
		return NewSQLPool(p), nil
	case *pgxpool.Pool:
		if p == nil {
			break
		}
		return NewPgxPool(p), nil
	case Pool:
		return p, nil
	case postgres.DB:
		return FromDB(p)
	}
	if x == nil || fmt.Sprint(x) == "<nil>" {
		return nil, fmt.Errorf("%w: nil pool: pass an open *sql.DB or *pgxpool.Pool", ErrUnsupported)
	}
	return nil, fmt.Errorf("%w: %T is not a pool: pass a *sql.DB or a *pgxpool.Pool", ErrUnsupported, x)
}

// FromDB returns the Pool of a postgres.DB; a zero DB is an error that
// wraps postgres.ErrNoDB (and ErrUnsupported) and names the fix.
func FromDB(d postgres.DB) (Pool, error) {
	switch {
	case d.Pgx() != nil:
		return NewPgxPool(d.Pgx()), nil
	case d.SQL() != nil:
		return NewSQLPool(d.SQL()), nil
	}
	return nil, fmt.Errorf("%w: %w", ErrUnsupported, d.Valid())
}

// FromTx returns the Querier of a postgres.Tx; a zero Tx is an error that
// wraps postgres.ErrNoDB (and ErrUnsupported) and names the fix.
func FromTx(t postgres.Tx) (Querier, error) {
	if q, ok := txhook.Unwrap(t).(Querier); ok {
		return q, nil
	}
	switch {
	case t.Pgx() != nil:
		return NewPgx(t.Pgx()), nil
	case t.SQL() != nil:
		return NewSQL(t.SQL()), nil
	}
	return nil, fmt.Errorf("%w: %w", ErrUnsupported, t.Valid())
}

// TxOf returns the postgres.Tx of a storage transaction, for user code.
func TxOf(tx Tx) postgres.Tx {
	switch h := tx.Handle().(type) {
	case *sql.Tx:
		return postgres.SQLTx(h)
	case pgx.Tx:
		return postgres.PgxTx(h)
	}
	return postgres.Tx{}
}

// FromHandle returns the Querier of a postgres.DB or postgres.Tx.
func FromHandle(h postgres.Handle) (Querier, error) {
	switch h := h.(type) {
	case postgres.DB:
		return FromDB(h)
	case postgres.Tx:
		return FromTx(h)
	}
	return nil, fmt.Errorf("%w: nil handle: pass a postgres.DB or postgres.Tx (%w)", ErrUnsupported, postgres.ErrNoDB)
}

// AsTx returns a postgres.Tx holding q (a transaction or statement queue
// of millwright's own), for a public write that takes a postgres.Tx.
func AsTx(q Querier) postgres.Tx {
	return txhook.Wrap(q).(postgres.Tx)
}
