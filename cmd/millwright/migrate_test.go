package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/lib/pq"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

// TestMigrateDryRunListsAndChangesNothing: --dry-run lists every pending
// migration (with --sql, their SQL) and applies none; after a real run it
// says the database is up to date.
func TestMigrateDryRunListsAndChangesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()
	pending, err := migrate.Pending(ctx, postgres.From(s.DB), migrationSources...)
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

// --schema takes any plain identifier it accepts, up to 63 bytes and in
// any case: migrate creates the schema the other commands then use (an
// unquoted name, folded to lower case as Postgres folds it in
// search_path). Before, a name with a capital letter made migrate create
// "Name" and then look for name: "no schema has been selected to create
// in".
func TestMigrateSchemaFlag_LongAndMixedCase(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "Mw_" + hex.EncodeToString(b[:]) + "_"
	name += strings.Repeat("X", 63-len(name))
	lower := strings.ToLower(name)
	t.Cleanup(func() {
		_, _ = s.DB.Exec(`DROP SCHEMA IF EXISTS ` + pq.QuoteIdentifier(lower) + ` CASCADE`)
		_, _ = s.DB.Exec(`DROP SCHEMA IF EXISTS ` + pq.QuoteIdentifier(name) + ` CASCADE`)
	})
	out, _, err := runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "--schema", name, "migrate")
	require.NoError(t, err, "migrate --schema %s", name)
	require.Contains(t, out, "applied outbox 006_outbox_notify_channel_bound")
	var in string
	require.NoError(t, s.DB.QueryRow(`SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relname = 'millwright_outbox' AND n.nspname IN ($1, $2)`, name, lower).Scan(&in))
	require.Equal(t, lower, in)
	var stray bool
	require.NoError(t, s.DB.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, name).Scan(&stray))
	require.False(t, stray, "no schema of the unfolded name")
	out, _, err = runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "outbox", "status", "--schema", name)
	require.NoError(t, err, "outbox status finds the migrated outbox; out:\n%s", out)
}

// A database URL whose search_path names a schema that does not exist:
// migrate names the schema and both fixes (create it, or --schema), not
// a connection problem; with --schema it creates the schema and migrates.
func TestMigrateIntoMissingSchemaNamesIt(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	missing := s.Name + "_nope"
	t.Cleanup(func() { _, _ = s.DB.Exec(`DROP SCHEMA IF EXISTS ` + missing + ` CASCADE`) })
	_, _, err := runCLI(t, freshRoot(), nil, pgtest.WithSearchPath(pgtest.BaseURL(), missing), "migrate")
	require.Error(t, err)
	for _, want := range []string{`schema "` + missing + `" does not exist`, `CREATE SCHEMA "` + missing + `"`, "--schema NAME", "$MILLWRIGHT_SCHEMA"} {
		require.Contains(t, err.Error(), want)
	}
	require.NotContains(t, err.Error(), "is Postgres running")
	require.NotContains(t, err.Error(), "connecting to database")

	out, _, err := runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "--schema", missing, "migrate")
	require.NoError(t, err, "migrate --schema %s", missing)
	require.Contains(t, out, "applied outbox 001_outbox")
}
