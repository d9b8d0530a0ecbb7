package pgconn_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// firstSetup opens a pool of Open on a fresh schema with a table t (a
// unique column) and a one-connection pool, so every transaction below runs
// on the same connection and a connection left in a bad state shows.
func firstSetup(t *testing.T) *sql.DB {
	t.Helper()
	return openOnePool(t, pgtest.New(t))
}

// openOnePool creates table t in s and opens a one-connection pool of Open
// on s.
func openOnePool(t *testing.T, s *pgtest.Schema) *sql.DB {
	t.Helper()
	_, err := s.DB.Exec(`CREATE TABLE t (k TEXT PRIMARY KEY)`)
	require.NoError(t, err)
	db, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	return db
}

// count runs a query returning one integer.
func count(t *testing.T, db *sql.DB, q string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(q).Scan(&n))
	return n
}

func TestFirstStatementTravelsWithBegin(t *testing.T) {
	t.Parallel()
	db := firstSetup(t)
	ctx := context.Background()

	first := &pgconn.FirstStatement{SQL: `INSERT INTO t VALUES ('a') ON CONFLICT DO NOTHING`}
	tx, err := db.BeginTx(pgconn.WithFirstStatement(ctx, first), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	require.NoError(t, err)
	require.True(t, first.Sent)
	require.EqualValues(t, 1, first.RowsAffected)
	// The statement ran inside the transaction: the row is there for it,
	// and its isolation level is the one asked for.
	var level string
	require.NoError(t, tx.QueryRow(`SHOW transaction_isolation`).Scan(&level))
	require.Equal(t, "read committed", level)
	var xid1, xid2 string
	require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id()::text`).Scan(&xid1))
	require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id()::text`).Scan(&xid2))
	require.Equal(t, xid1, xid2, "one transaction across the statements")
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM t`))

	// A conflict: the row count says so.
	first = &pgconn.FirstStatement{SQL: `INSERT INTO t VALUES ('a') ON CONFLICT DO NOTHING`}
	tx, err = db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	require.NoError(t, err)
	require.True(t, first.Sent)
	require.EqualValues(t, 0, first.RowsAffected)
	require.NoError(t, tx.Rollback())

	// Rolled back: nothing stays.
	first = &pgconn.FirstStatement{SQL: `INSERT INTO t VALUES ('b')`}
	tx, err = db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM t`))
	require.ErrorIs(t, tx.Commit(), sql.ErrTxDone)
}

// The statement's error is BeginTx's, as a *pq.Error, and leaves no
// transaction open on the connection.
func TestFirstStatementErrorLeavesNoTransaction(t *testing.T) {
	t.Parallel()
	db := firstSetup(t)
	ctx := context.Background()

	first := &pgconn.FirstStatement{SQL: `INSERT INTO missing VALUES (1)`}
	_, err := db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("42P01"), pqErr.Code)
	require.False(t, first.Sent)

	// The one connection is outside a transaction: an autocommit insert
	// is visible from another connection at once.
	_, err = db.Exec(`INSERT INTO t VALUES ('c')`)
	require.NoError(t, err)
	var inTx bool
	require.NoError(t, db.QueryRow(`SELECT now() <> statement_timestamp()`).Scan(&inTx))
	require.False(t, inTx, "the connection is not inside a transaction")
}

// A transaction in which a statement failed cannot commit: Commit reports
// it, the rows of the transaction are gone, and the connection is usable.
func TestFirstStatementFailedTransactionDoesNotCommit(t *testing.T) {
	t.Parallel()
	db := firstSetup(t)
	ctx := context.Background()

	first := &pgconn.FirstStatement{SQL: `INSERT INTO t VALUES ('d')`}
	tx, err := db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('d')`) // duplicate key: the transaction fails
	require.Error(t, err)
	err = tx.Commit()
	require.ErrorIs(t, err, pgconn.ErrTxAborted)
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM t`))

	// A commit that fails at COMMIT (a deferred constraint) is an error too.
	_, err = db.Exec(`CREATE TABLE d (k TEXT, CONSTRAINT u UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	first = &pgconn.FirstStatement{SQL: `INSERT INTO d VALUES ('x')`}
	tx, err = db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO d VALUES ('x')`)
	require.NoError(t, err, "deferred: the violation shows at COMMIT")
	err = tx.Commit()
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("23505"), pqErr.Code)
	require.False(t, errors.Is(err, pgconn.ErrTxAborted))
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM d`))

	// The connection works, inside and outside transactions.
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('e')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM t`))
}

// A pool that is not one of Open ignores the request: Sent stays false.
func TestFirstStatementIgnoredElsewhere(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	first := &pgconn.FirstStatement{SQL: `SELECT 1`}
	tx, err := s.DB.BeginTx(pgconn.WithFirstStatement(context.Background(), first), nil)
	require.NoError(t, err)
	require.False(t, first.Sent)
	require.NoError(t, tx.Rollback())
}
