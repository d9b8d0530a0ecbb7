package postgres_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// On a pool of Open the idempotency mark travels with BEGIN: right after
// BeginMark the session's last query, as the server shows it in
// pg_stat_activity, is BEGIN and the mark in one query string (one round
// trip), and the transaction holds the mark.
// The same holds on a pool of OpenPgx.
func TestOpenPoolSendsTheMarkWithBegin(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		s := pgtest.New(t, idempotency.Migrations())
		var (
			store *idempotency.PostgresStore
			err   error
		)
		if driver == pgtest.DriverPgx {
			pool, perr := postgres.OpenPgx(context.Background(), s.URL)
			require.NoError(t, perr)
			defer pool.Close()
			store, err = idempotency.NewPostgresStore(postgres.From(pool))
		} else {
			db, oerr := postgres.Open(s.URL)
			require.NoError(t, oerr)
			defer db.Close()
			store, err = idempotency.NewPostgresStore(postgres.From(db))
		}
		require.NoError(t, err)
		testMarkTravelsWithBegin(t, s, store)
	})
}

func testMarkTravelsWithBegin(t *testing.T, s *pgtest.Schema, store *idempotency.PostgresStore) {
	ctx := context.Background()

	event := fmt.Sprintf("e-%d", time.Now().UnixNano())
	tx, fresh, err := store.BeginMark(ctx, "c", event)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // after Commit: no-op
	require.True(t, fresh)
	var query string
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT query FROM pg_stat_activity
		WHERE state = 'idle in transaction' AND query LIKE '%' || $1 || '%'`, event).Scan(&query))
	// The mark's row count is checked on the server (the storage layer's
	// Expect), hence the WITH around the INSERT.
	require.Regexp(t, `^(?i)BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE;\s*SET LOCAL lock_timeout = \d+;\s*INSERT INTO millwright_processed_events .*`+event, query)
	require.NoError(t, tx.Commit())
	seen, err := store.Processed(ctx, "c", event)
	require.NoError(t, err)
	require.True(t, seen)
}
