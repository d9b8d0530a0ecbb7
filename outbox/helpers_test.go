package outbox

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// driverBundle is a schema with the outbox's tables and a pool of one
// driver: handle is its *sql.DB or a *pgxpool.Pool. (The relay's tests,
// package outbox/relay, have their own.)
type driverBundle struct {
	db     *sql.DB
	schema *pgtest.Schema
	handle any
	pdb    postgres.DB // handle's DB
}

func setupDriver(t *testing.T, driver string) driverBundle {
	t.Helper()
	s := pgtest.New(t, Migrations())
	var h any = s.DB
	if driver == pgtest.DriverPgx {
		h = s.Pgx(t)
	}
	pdb := postgres.SQL(s.DB)
	if p, ok := h.(*pgxpool.Pool); ok {
		pdb = postgres.Pgx(p)
	}
	return driverBundle{db: s.DB, schema: s, handle: h, pdb: pdb}
}

func count(t *testing.T, db *sql.DB, where string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+where).Scan(&n))
	return n
}

// userTx is a user's transaction on either driver.
type userTx struct {
	tx       postgres.Tx // what the user passes to Add
	exec     func(q string) error
	pid      func() int
	commit   func() error
	rollback func() error
}

func begin(t *testing.T, h any) userTx {
	t.Helper()
	ctx := context.Background()
	switch db := h.(type) {
	case *sql.DB:
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback() })
		return userTx{tx: postgres.SQLTx(tx),
			exec: func(q string) error { _, err := tx.ExecContext(ctx, q); return err },
			pid: func() int {
				var pid int
				require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
				return pid
			},
			commit: tx.Commit, rollback: tx.Rollback}
	case *pgxpool.Pool:
		tx, err := db.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return userTx{tx: postgres.PgxTx(tx),
			exec: func(q string) error { _, err := tx.Exec(ctx, q); return err },
			pid: func() int {
				var pid int
				require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
				return pid
			},
			commit: func() error { return tx.Commit(ctx) }, rollback: func() error { return tx.Rollback(ctx) }}
	}
	t.Fatalf("no transaction on a %T", h)
	return userTx{}
}
