package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/migrate"
)

// TestMigrateDryRunListsAndChangesNothing: --dry-run lists every pending
// migration (with --sql, their SQL) and applies none; after a real run it
// says the database is up to date.
func TestMigrateDryRunListsAndChangesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()
	pending, err := migrate.Pending(ctx, s.DB, migrationSources...)
	require.NoError(t, err)
	require.NotEmpty(t, pending)

	out, _, err := runCLI(t, migrateCmd(), nil, s.URL, "--dry-run")
	require.NoError(t, err)
	for _, m := range pending {
		require.Contains(t, out, "would apply "+m.Component+" ")
	}
	require.NotContains(t, out, "CREATE TABLE")
	var exists bool
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT to_regclass('millwright_outbox') IS NOT NULL OR to_regclass('millwright_migrations') IS NOT NULL`).Scan(&exists))
	require.False(t, exists, "a dry run changes nothing")

	out, _, err = runCLI(t, migrateCmd(), nil, s.URL, "--dry-run", "--sql")
	require.NoError(t, err)
	require.Contains(t, out, "CREATE TABLE millwright_outbox")

	_, _, err = runCLI(t, migrateCmd(), nil, s.URL, "--sql")
	require.ErrorContains(t, err, "nothing was applied", "--sql alone must not migrate")
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT to_regclass('millwright_migrations') IS NOT NULL`).Scan(&exists))
	require.False(t, exists)

	out, _, err = runCLI(t, migrateCmd(), nil, s.URL)
	require.NoError(t, err)
	require.Contains(t, out, "applied outbox 001_outbox")
	out, _, err = runCLI(t, migrateCmd(), nil, s.URL, "--dry-run")
	require.NoError(t, err)
	require.Equal(t, "database is up to date\n", out)
}
