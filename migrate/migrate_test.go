package migrate_test

import (
	"context"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/migrate"
)

func source() migrate.Source {
	return migrate.Source{Component: "demo", FS: fstest.MapFS{
		"001_create.sql": {Data: []byte(`CREATE TABLE demo_items (id INT PRIMARY KEY)`)},
		"002_column.sql": {Data: []byte(`ALTER TABLE demo_items ADD COLUMN name TEXT`)},
		"README.md":      {Data: []byte(`ignored`)},
	}}
}

func TestUpAppliesEachVersionOnceEvenConcurrently(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()

	var wg sync.WaitGroup
	applied := make([][]migrate.Applied, 4)
	errs := make([]error, 4)
	for i := range applied {
		wg.Add(1)
		go func() {
			defer wg.Done()
			applied[i], errs[i] = migrate.Up(ctx, s.DB, source())
		}()
	}
	wg.Wait()
	total := 0
	for i := range applied {
		require.NoError(t, errs[i])
		total += len(applied[i])
	}
	require.Equal(t, 2, total, "each migration applied exactly once across concurrent migrators")

	again, err := migrate.Up(ctx, s.DB, source())
	require.NoError(t, err)
	require.Empty(t, again)
	_, err = s.DB.ExecContext(ctx, `INSERT INTO demo_items (id, name) VALUES (1, 'x')`)
	require.NoError(t, err)
}

func TestFailedMigrationIsNotRecorded(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	bad := migrate.Source{Component: "bad", FS: fstest.MapFS{
		"001_ok.sql":     {Data: []byte(`CREATE TABLE bad_ok (id INT)`)},
		"002_broken.sql": {Data: []byte(`CREATE TABLE nope (`)},
	}}
	applied, err := migrate.Up(context.Background(), s.DB, bad)
	require.ErrorContains(t, err, "bad 002_broken")
	require.Len(t, applied, 1)
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_migrations WHERE component = 'bad'`).Scan(&n))
	require.Equal(t, 1, n)
}

func TestLoadRejectsBadFileNames(t *testing.T) {
	t.Parallel()
	_, err := migrate.Load(migrate.Source{Component: "x", FS: fstest.MapFS{"create.sql": {Data: []byte("SELECT 1")}}})
	require.ErrorContains(t, err, "NNN_description.sql")
	_, err = migrate.Load(migrate.Source{Component: "x", FS: fstest.MapFS{
		"001_a.sql": {Data: []byte("SELECT 1")}, "01_b.sql": {Data: []byte("SELECT 1")},
	}})
	require.ErrorContains(t, err, "version 1 used by both")
	_, err = migrate.Load(migrate.Source{FS: fstest.MapFS{}})
	require.ErrorContains(t, err, "empty Component")
}

func TestEmbedded(t *testing.T) {
	fsys := fstest.MapFS{"migrations/001_a.sql": {Data: []byte(`SELECT 1`)}}
	ms, err := migrate.Load(migrate.Embedded("demo", fsys, "migrations"))
	require.NoError(t, err)
	require.Len(t, ms, 1)
	require.Equal(t, "demo", ms[0].Component)
	require.PanicsWithValue(t, `demo: embedded migrations missing: sub ../x: invalid argument`, func() { migrate.Embedded("demo", fsys, "../x") })
}

func TestPendingListsWhatUpWouldApplyAndChangesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()

	pending, err := migrate.Pending(ctx, s.DB, source())
	require.NoError(t, err)
	require.Len(t, pending, 2, "never migrated: everything is pending")
	require.Equal(t, []int{1, 2}, []int{pending[0].Version, pending[1].Version})
	var exists bool
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT to_regclass('millwright_migrations') IS NOT NULL`).Scan(&exists))
	require.False(t, exists, "Pending creates nothing")

	one := migrate.Source{Component: "demo", FS: fstest.MapFS{"001_create.sql": source().FS.(fstest.MapFS)["001_create.sql"]}}
	_, err = migrate.Up(ctx, s.DB, one)
	require.NoError(t, err)
	pending, err = migrate.Pending(ctx, s.DB, source())
	require.NoError(t, err)
	require.Len(t, pending, 1)
	require.Equal(t, "column", pending[0].Name)

	_, err = migrate.Up(ctx, s.DB, source())
	require.NoError(t, err)
	pending, err = migrate.Pending(ctx, s.DB, source())
	require.NoError(t, err)
	require.Empty(t, pending)
}
