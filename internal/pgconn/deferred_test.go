package pgconn_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/pgtest"
)

// deferredSetup is firstSetup plus pgtest's own lib/pq pool on the same
// schema, to look at the first from outside.
func deferredSetup(t *testing.T) (db, other *sql.DB) {
	t.Helper()
	s := pgtest.New(t)
	return openOnePool(t, s), s.DB
}

// A deferred statement goes out with COMMIT, as one query: the server's
// record of the session's last query is both, and the row is committed.
func TestDeferredTravelsWithCommit(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	var pid int
	require.NoError(t, tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	res, err := tx.ExecContext(pgconn.WithDeferred(ctx, "inserting a"), `INSERT INTO t VALUES ('a')`)
	require.NoError(t, err)
	_, err = res.RowsAffected()
	require.Error(t, err, "a deferred statement has no row count yet")
	require.Equal(t, "SELECT pg_backend_pid()", pgtest.LastQuery(t, other, pid), "not sent before COMMIT")
	require.Equal(t, 0, count(t, other, `SELECT count(*) FROM t`))
	require.NoError(t, tx.Commit())
	require.Equal(t, "INSERT INTO t VALUES ('a');\nCOMMIT", pgtest.LastQuery(t, other, pid))
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t`))

	// Several deferred statements keep their order: the second sees the
	// first's row.
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	dctx := pgconn.WithDeferred(ctx, "inserting")
	_, err = tx.ExecContext(dctx, `INSERT INTO t VALUES ('b')`)
	require.NoError(t, err)
	_, err = tx.ExecContext(dctx, `INSERT INTO t SELECT k || '2' FROM t WHERE k = 'b'`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.Equal(t, 3, count(t, other, `SELECT count(*) FROM t WHERE k IN ('a', 'b', 'b2')`))
}

// A later statement of the transaction, prepared or not, sends the
// deferred ones first and sees their effects.
func TestDeferredRunsBeforeTheNextStatement(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting c"), `INSERT INTO t VALUES ('c')`)
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRow(`SELECT count(*) FROM t WHERE k = $1`, "c").Scan(&n))
	require.Equal(t, 1, n, "a query sees the deferred insert")

	st, err := tx.Prepare(`SELECT count(*) FROM t WHERE k = $1`)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting d"), `INSERT INTO t VALUES ('d')`)
	require.NoError(t, err)
	require.NoError(t, st.QueryRow("d").Scan(&n))
	require.Equal(t, 1, n, "a prepared statement sees the deferred insert")
	require.NoError(t, st.Close())

	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting e"), `INSERT INTO t VALUES ('e')`)
	require.NoError(t, err)
	res, err := tx.Exec(`DELETE FROM t WHERE k = 'e'`)
	require.NoError(t, err)
	gone, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, gone, "an Exec sees the deferred insert")
	require.NoError(t, tx.Commit())
	require.Equal(t, 2, count(t, other, `SELECT count(*) FROM t`))
}

// A deferred statement that fails fails the COMMIT that carries it, naming
// what it did: nothing of the transaction is committed, and the
// connection is usable after.
func TestDeferredErrorFailsCommit(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('f')`)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting into missing"), `INSERT INTO missing VALUES (1)`)
	require.NoError(t, err, "not sent yet")
	err = tx.Commit()
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("42P01"), pqErr.Code)
	require.Contains(t, err.Error(), "inserting into missing")
	require.Contains(t, err.Error(), "nothing committed")
	require.Equal(t, 0, count(t, other, `SELECT count(*) FROM t`))

	// The connection is outside a transaction and works.
	var inTx bool
	require.NoError(t, db.QueryRow(`SELECT now() <> statement_timestamp()`).Scan(&inTx))
	require.False(t, inTx)
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting g"), `INSERT INTO t VALUES ('g')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t`))

	// Failing before a later statement: that statement reports it, and
	// the transaction cannot commit.
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting g again"), `INSERT INTO t VALUES ('g')`)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('h')`)
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("23505"), pqErr.Code)
	require.Contains(t, err.Error(), "inserting g again")
	require.ErrorIs(t, tx.Commit(), pgconn.ErrTxAborted)
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t`))

	// Deferred after a statement had failed: Commit says the transaction
	// had failed, not that the deferred statement did.
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('g')`)
	require.Error(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting i"), `INSERT INTO t VALUES ('i')`)
	require.NoError(t, err)
	err = tx.Commit()
	require.ErrorIs(t, err, pgconn.ErrTxAborted)
	require.ErrorIs(t, err, pq.ErrInFailedTransaction, "lib/pq's error for it, as lib/pq's transactions return")
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t`))
}

// Rollback discards deferred statements: they never reach the server, and
// the next transaction on the connection does not send them.
func TestDeferredDiscardedByRollback(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting j"), `INSERT INTO t VALUES ('j')`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())

	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES ('k')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	var keys []string
	rows, err := other.Query(`SELECT k FROM t ORDER BY k`)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"k"}, keys)
}

// Outside a transaction, with parameters, or on another pool, a deferred
// statement runs at once.
func TestDeferredRunsAtOnceElsewhere(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := pgconn.WithDeferred(context.Background(), "inserting")

	res, err := db.ExecContext(ctx, `INSERT INTO t VALUES ('l')`)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t WHERE k = 'l'`), "no transaction: committed at once")

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	res, err = tx.ExecContext(ctx, `INSERT INTO t VALUES ($1)`, "m")
	require.NoError(t, err)
	n, err = res.RowsAffected()
	require.NoError(t, err, "with parameters: run at once")
	require.EqualValues(t, 1, n)
	require.NoError(t, tx.Commit())

	tx, err = other.BeginTx(ctx, nil)
	require.NoError(t, err)
	res, err = tx.ExecContext(ctx, `INSERT INTO t VALUES ('n')`)
	require.NoError(t, err)
	n, err = res.RowsAffected()
	require.NoError(t, err, "another pool: run at once")
	require.EqualValues(t, 1, n)
	require.NoError(t, tx.Rollback())
	require.Equal(t, 2, count(t, other, `SELECT count(*) FROM t`))
}

// A transaction begun with a first statement defers as any other: BEGIN
// carries the first, COMMIT the deferred one.
func TestDeferredWithFirstStatement(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()
	first := &pgconn.FirstStatement{SQL: `INSERT INTO t VALUES ('o')`}
	tx, err := db.BeginTx(pgconn.WithFirstStatement(ctx, first), nil)
	require.NoError(t, err)
	require.True(t, first.Sent)
	_, err = tx.ExecContext(pgconn.WithDeferred(ctx, "inserting p"), `INSERT INTO t VALUES ('p')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.Equal(t, 2, count(t, other, `SELECT count(*) FROM t`))
}

// A deferred statement may return rows, and may fail after returning some:
// COMMIT still reads to its own result, and the failure fails it.
func TestDeferredStatementReturningRows(t *testing.T) {
	t.Parallel()
	db, other := deferredSetup(t)
	ctx := context.Background()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	dctx := pgconn.WithDeferred(ctx, "inserting and selecting")
	_, err = tx.ExecContext(dctx, `WITH x AS (INSERT INTO t VALUES ('q') RETURNING k) SELECT k FROM x, generate_series(1, 3)`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, count(t, other, `SELECT count(*) FROM t WHERE k = 'q'`))

	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(dctx, `INSERT INTO t VALUES ('r')`)
	require.NoError(t, err)
	_, err = tx.ExecContext(dctx, `SELECT 1 / (x - 2) FROM generate_series(0, 2) x`) // rows, then division by zero
	require.NoError(t, err)
	err = tx.Commit()
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, pq.ErrorCode("22012"), pqErr.Code)
	require.Equal(t, 0, count(t, other, `SELECT count(*) FROM t WHERE k = 'r'`))
	require.NoError(t, db.Ping(), "the connection is usable")
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM t`))
}
