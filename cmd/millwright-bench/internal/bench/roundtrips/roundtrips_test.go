package roundtrips

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"
	_ "github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// The counter tells lib/pq's two round trips for a statement with
// arguments from pgx's one, and a pgx batch from separate statements.
func TestCountsRoundTripsPerDriver(t *testing.T) {
	ctx := context.Background()
	c, u, err := Start(pgtest.BaseURL())
	require.NoError(t, err)
	defer c.Close()

	db, err := sql.Open("postgres", u)
	require.NoError(t, err)
	defer db.Close()
	db.SetMaxOpenConns(1)
	require.NoError(t, db.PingContext(ctx))
	n := c.Count()
	var x int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT $1::int`, 1).Scan(&x))
	require.EqualValues(t, 2, c.Count()-n, "lib/pq: parse, then bind and execute")
	n = c.Count()
	require.NoError(t, db.QueryRowContext(ctx, `SELECT 1`).Scan(&x))
	require.EqualValues(t, 1, c.Count()-n, "lib/pq: a simple query")

	conn, err := pgx.Connect(ctx, u)
	require.NoError(t, err)
	defer conn.Close(ctx)
	require.NoError(t, conn.QueryRow(ctx, `SELECT $1::int`, 1).Scan(&x)) // prepares and caches
	n = c.Count()
	require.NoError(t, conn.QueryRow(ctx, `SELECT $1::int`, 2).Scan(&x))
	require.EqualValues(t, 1, c.Count()-n, "pgx: one extended-protocol round trip once cached")
	b := &pgx.Batch{}
	b.Queue(`SELECT $1::int`, 3)
	b.Queue(`SELECT $1::int`, 4)
	b.Queue(`SELECT $1::int`, 5)
	n = c.Count()
	require.NoError(t, conn.SendBatch(ctx, b).Close())
	require.EqualValues(t, 1, c.Count()-n, "pgx: a batch of cached statements is one round trip")
}
