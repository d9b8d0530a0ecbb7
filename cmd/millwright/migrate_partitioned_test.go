package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
)

// TestMigrateOutboxPartitioned: the partitioned outbox is chosen with
// --outbox-partitioned only, after a plain migrate as on a fresh
// database, and later runs without the flag leave it as it is.
func TestMigrateOutboxPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	layout := func(s *pgtest.Schema) string {
		var k string
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT relkind FROM pg_class WHERE oid = 'millwright_outbox'::regclass`).Scan(&k))
		return k
	}

	plain := pgtest.New(t)
	out, _, err := runCLI(t, migrateCmd(), nil, plain.URL)
	require.NoError(t, err)
	require.NotContains(t, out, "outbox_partitioned")
	require.Equal(t, "r", layout(plain), "the default layout is the plain table")

	out, _, err = runCLI(t, migrateCmd(), nil, plain.URL, "--outbox-partitioned", "--dry-run")
	require.NoError(t, err)
	require.Equal(t, "would apply outbox_partitioned 001_outbox_partitioned\n", out)
	out, _, err = runCLI(t, migrateCmd(), nil, plain.URL, "--outbox-partitioned")
	require.NoError(t, err)
	require.Equal(t, "applied outbox_partitioned 001_outbox_partitioned\n", out)
	require.Equal(t, "p", layout(plain))
	out, _, err = runCLI(t, migrateCmd(), nil, plain.URL)
	require.NoError(t, err)
	require.Equal(t, "database is up to date\n", out)
	require.Equal(t, "p", layout(plain))

	fresh := pgtest.New(t)
	out, _, err = runCLI(t, migrateCmd(), nil, fresh.URL, "--outbox-partitioned")
	require.NoError(t, err)
	require.Contains(t, out, "applied outbox 001_outbox")
	require.Contains(t, out, "applied outbox_partitioned 001_outbox_partitioned")
	require.Equal(t, "p", layout(fresh))
}
