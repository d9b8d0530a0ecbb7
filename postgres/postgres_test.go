package postgres_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/postgres"
)

// On a pool of Open the idempotency mark travels with BEGIN: right after
// BeginMark the session's last query, as the server shows it in
// pg_stat_activity, is BEGIN and the mark in one query string (one round
// trip), and the transaction holds the mark.
func TestOpenPoolSendsTheMarkWithBegin(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, idempotency.Migrations())
	db, err := postgres.Open(s.URL)
	require.NoError(t, err)
	defer db.Close()
	store, err := idempotency.NewPostgresStore(db)
	require.NoError(t, err)
	ctx := context.Background()

	event := fmt.Sprintf("e-%d", time.Now().UnixNano())
	tx, fresh, err := store.BeginMark(ctx, "c", event)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // after Commit: no-op
	require.True(t, fresh)
	var query string
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT query FROM pg_stat_activity
		WHERE state = 'idle in transaction' AND query LIKE '%' || $1 || '%'`, event).Scan(&query))
	require.Regexp(t, `^BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE; SET LOCAL lock_timeout = \d+; INSERT INTO millwright_processed_events .*`+event, query)
	require.NoError(t, tx.Commit())
	seen, err := store.Processed(ctx, "c", event)
	require.NoError(t, err)
	require.True(t, seen)
}
