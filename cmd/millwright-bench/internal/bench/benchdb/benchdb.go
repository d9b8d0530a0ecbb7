// Package benchdb opens what every `millwright-bench` needs from Postgres:
// a throw-away schema (Scratch, Schema) and a pool of either driver the
// benches compare side by side (Open), with a transaction that hides which
// (Pool.Begin). It replaces the copies each bench package had; benches
// keep their own figures and reports.
//
// Scratch schemas are created and dropped through internal/storage (the
// one layer holding SQL on millwright's objects); a dropped schema takes
// everything a run made in it.
package benchdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// The drivers a bench measures on.
const (
	// DriverPQ is lib/pq through pgconn.Open (as postgres.Open opens it).
	DriverPQ = "pq"
	// DriverPgx is a pgxpool.Pool.
	DriverPgx = "pgx"
)

// Schema creates schema through admin, on the server base reaches, and
// returns a URL like base whose search_path points at it and a function
// that drops it with all it holds (best effort, after ctx ends too, and
// within DropTimeout: a lock held elsewhere must not hang the bench's end).
func Schema(ctx context.Context, admin *sql.DB, base, schema string) (schemaURL string, drop func(), err error) {
	q := storage.NewSQLPool(admin)
	if err := storage.CreateSchema(ctx, q, schema, false); err != nil {
		return "", nil, fmt.Errorf("creating scratch schema %s on %s: %w", schema, redact.URL(base), err)
	}
	return pgtest.WithSearchPath(base, schema), func() {
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), DropTimeout)
		defer cancel()
		_ = storage.DropSchema(c, q, schema)
	}, nil
}

// DropTimeout bounds dropping a scratch schema.
const DropTimeout = time.Minute

// Scratch is Schema with a new name, prefix_<10 random hex digits>, which
// it returns too.
func Scratch(ctx context.Context, admin *sql.DB, base, prefix string) (schema, schemaURL string, drop func(), err error) {
	var b [5]byte
	_, _ = rand.Read(b[:])
	schema = prefix + "_" + hex.EncodeToString(b[:])
	schemaURL, drop, err = Schema(ctx, admin, base, schema)
	if err != nil {
		return "", "", nil, err
	}
	return schema, schemaURL, drop, nil
}

// Pool is one driver's pool: DB on DriverPQ, Pgx on DriverPgx, the other
// nil. It is safe for concurrent use.
type Pool struct {
	Driver string
	DB     *sql.DB
	Pgx    *pgxpool.Pool
}

// Open opens driver's pool on rawURL holding at most conns connections
// (and, on pq, keeping them idle rather than closing them between
// transactions, as pgxpool does). No connection is made yet.
func Open(ctx context.Context, driver, rawURL string, conns int) (*Pool, error) {
	switch driver {
	case DriverPQ:
		db, err := pgconn.Open(rawURL)
		if err != nil {
			return nil, err
		}
		db.SetMaxOpenConns(conns)
		db.SetMaxIdleConns(conns)
		return &Pool{Driver: driver, DB: db}, nil
	case DriverPgx:
		cfg, err := pgconn.PgxConfig(rawURL)
		if err != nil {
			return nil, err
		}
		cfg.MaxConns = int32(min(conns, 1<<30)) //nolint:gosec // bounded just above
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, redact.Error(err)
		}
		return &Pool{Driver: driver, Pgx: p}, nil
	}
	return nil, fmt.Errorf("unknown driver %q: want %s or %s", driver, DriverPQ, DriverPgx)
}

// Close closes the pool.
func (p *Pool) Close() {
	if p.Pgx != nil {
		p.Pgx.Close()
	}
	if p.DB != nil {
		_ = p.DB.Close()
	}
}

// Build calls onPQ or onPgx with p's pool: millwright's constructors are
// generic over the two pool types, so a bench builds its parts once per
// type, not once per driver branch of its own.
func Build[T any](p *Pool, onPQ func(*sql.DB) (T, error), onPgx func(*pgxpool.Pool) (T, error)) (T, error) {
	if p.Pgx != nil {
		return onPgx(p.Pgx)
	}
	return onPQ(p.DB)
}

// Tx is a transaction on either driver. Not for concurrent use.
type Tx struct {
	sql *sql.Tx
	pgx pgx.Tx
}

// Begin starts a transaction with the driver's default options.
func (p *Pool) Begin(ctx context.Context) (*Tx, error) {
	if p.Pgx != nil {
		tx, err := p.Pgx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		return &Tx{pgx: tx}, nil
	}
	tx, err := p.DB.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	return &Tx{sql: tx}, nil
}

// Handle is the transaction for the calls that take the caller's
// transaction (saga's Start, outbox.Add).
func (t *Tx) Handle() postgres.Tx {
	if t.pgx != nil {
		return postgres.PgxTx(t.pgx)
	}
	return postgres.SQLTx(t.sql)
}

// Exec runs q with args in the transaction.
func (t *Tx) Exec(ctx context.Context, q string, args ...any) error {
	var err error
	if t.pgx != nil {
		_, err = t.pgx.Exec(ctx, q, args...)
	} else {
		_, err = t.sql.ExecContext(ctx, q, args...)
	}
	return err
}

// Commit commits the transaction.
func (t *Tx) Commit(ctx context.Context) error {
	if t.pgx != nil {
		return t.pgx.Commit(ctx)
	}
	return t.sql.Commit()
}

// Rollback rolls the transaction back; after Commit it does nothing.
func (t *Tx) Rollback(ctx context.Context) {
	if t.pgx != nil {
		_ = t.pgx.Rollback(ctx)
		return
	}
	_ = t.sql.Rollback()
}
