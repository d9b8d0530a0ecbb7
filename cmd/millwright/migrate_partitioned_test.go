package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
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

// The conversion to the partitioned outbox reports its progress (the
// migration's notices, 10000 rows a batch) and its summary on stderr,
// and keeps every row.
func TestMigrateOutboxPartitionedProgress(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	_, _, err := runCLI(t, migrateCmd(), nil, s.URL)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload)
		SELECT 'e-' || g, 'orders', 'o-' || g, '{}' FROM generate_series(1, 25000) g`)
	require.NoError(t, err)

	out, stderr, err := runCLI(t, migrateCmd(), nil, s.URL, "--outbox-partitioned")
	require.NoError(t, err, stderr)
	require.Equal(t, "applied outbox_partitioned 001_outbox_partitioned\n", out)
	require.Regexp(t, `(?m)^migrate: outbox partitioned conversion: 10000/25000 rows \(40%\), [0-9.]+/s, about .* left`, stderr)
	require.Regexp(t, `(?m)^migrate: outbox partitioned conversion: 20000/25000 rows \(80%\)`, stderr)
	require.Regexp(t, `(?m)^migrate: outbox partitioned conversion: done, 25000/25000 rows \(100%\) in [^ ]+ \([0-9.]+/s\); committed$`, stderr)
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox`).Scan(&n))
	require.Equal(t, 25000, n)
}
