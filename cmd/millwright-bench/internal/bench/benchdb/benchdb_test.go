package benchdb_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

func schemaExists(t *testing.T, db *sql.DB, schema string) bool {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema).Scan(&n))
	return n == 1
}

// A scratch schema is made, its URL lands in it on both drivers, a
// committed write stays and a rolled-back one does not, and drop removes
// the schema with what it holds.
func TestScratchAndPoolOnBothDrivers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgtest.New(t).DB
	base := pgtest.BaseURL()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		schema, schemaURL, drop, err := benchdb.Scratch(ctx, admin, base, "mw_benchdb_test")
		require.NoError(t, err)
		t.Cleanup(drop)
		require.Regexp(t, `^mw_benchdb_test_[0-9a-f]{10}$`, schema)
		require.True(t, schemaExists(t, admin, schema))

		p, err := benchdb.Open(ctx, driver, schemaURL, 2)
		require.NoError(t, err)
		defer p.Close()
		require.Equal(t, driver == benchdb.DriverPgx, p.Pgx != nil, "the pool of the driver asked for")
		require.Equal(t, driver == benchdb.DriverPQ, p.DB != nil)

		tx, err := p.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, tx.Exec(ctx, `CREATE TABLE t (v int)`))
		require.NoError(t, tx.Exec(ctx, `INSERT INTO t VALUES ($1)`, 1))
		require.NoError(t, tx.Handle().Valid())
		require.NoError(t, tx.Commit(ctx))
		tx.Rollback(ctx) // a no-op after Commit

		tx, err = p.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, tx.Exec(ctx, `INSERT INTO t VALUES ($1)`, 2))
		tx.Rollback(ctx)

		var n int
		require.NoError(t, admin.QueryRow(`SELECT count(*) FROM `+schema+`.t`).Scan(&n))
		require.Equal(t, 1, n, "the committed row only, in the scratch schema")

		p.Close()
		drop()
		require.False(t, schemaExists(t, admin, schema), "drop removes the schema and its table")
	})
}

func TestOpenUnknownDriver(t *testing.T) {
	t.Parallel()
	_, err := benchdb.Open(context.Background(), "mysql", pgtest.BaseURL(), 1)
	require.ErrorContains(t, err, `unknown driver "mysql": want pq or pgx`)
}
