package migrate_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

func source() migrate.Source {
	return migrate.Source{Component: "demo", FS: fstest.MapFS{
		"001_create.sql": {Data: []byte(`CREATE TABLE demo_items (id INT PRIMARY KEY)`)},
		"002_column.sql": {Data: []byte(`ALTER TABLE demo_items ADD COLUMN name TEXT`)},
		"README.md":      {Data: []byte(`ignored`)},
	}}
}

// Four migrators run Up at once; the first to get the lock stalls in its
// first migration until the other three are seen waiting for the lock, so
// they certainly overlap. Each version is applied once, by the first.
func TestUpAppliesEachVersionOnceEvenConcurrently(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx, cancel := context.WithCancel(context.Background())

	// The first migration waits on this test's own advisory lock (a
	// random key, so no other test shares it) until it is released.
	var kb [8]byte
	_, _ = rand.Read(kb[:])
	stall := int64(binary.BigEndian.Uint64(kb[:]) >> 1)
	src := source()
	fsys := src.FS.(fstest.MapFS)
	fsys["001_create.sql"] = &fstest.MapFile{Data: []byte(fmt.Sprintf(
		"SELECT pg_advisory_xact_lock(%d);\n%s", stall, fsys["001_create.sql"].Data))}

	const n = 4
	pids := make([]int, n)
	dbs := make([]*sql.DB, n)
	for i := range dbs {
		db, err := sql.Open("postgres", s.URL)
		require.NoError(t, err)
		db.SetMaxOpenConns(1) // one connection: its backend pid identifies the migrator
		t.Cleanup(func() { db.Close() })
		require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&pids[i]))
		dbs[i] = db
	}
	holder, err := sql.Open("postgres", s.URL)
	require.NoError(t, err)
	holder.SetMaxOpenConns(1)
	// Runs before the migrators' pools are closed (DB.Close waits for the
	// stalled migration): closing the session releases the stall.
	t.Cleanup(func() { cancel(); holder.Close() })
	_, err = holder.Exec(`SELECT pg_advisory_lock($1)`, stall)
	require.NoError(t, err)

	applied := make([][]migrate.Applied, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			applied[i], errs[i] = migrate.Up(ctx, postgres.From(dbs[i]), src)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()

	poll.Until(t, 10*time.Second, func() bool {
		var stalled, waiting int
		require.NoError(t, s.DB.QueryRow(`SELECT
				count(*) FILTER (WHERE query LIKE 'SELECT pg_advisory_xact_lock%'),
				count(*) FILTER (WHERE query LIKE 'SELECT pg_advisory_lock%')
			FROM pg_stat_activity WHERE pid = ANY($1) AND wait_event_type = 'Lock'`,
			pq.Array(pids)).Scan(&stalled, &waiting))
		return stalled == 1 && waiting == n-1
	}, "one migrator stalled in its first migration, the other %d waiting for the migration lock", n-1)
	_, err = holder.Exec(`SELECT pg_advisory_unlock($1)`, stall)
	require.NoError(t, err)

	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("migrators still running 30s after the stall was released")
	}
	total, first := 0, 0
	for i := range applied {
		require.NoError(t, errs[i])
		total += len(applied[i])
		if len(applied[i]) == 2 {
			first++
		}
	}
	require.Equal(t, 2, total, "each migration applied exactly once across concurrent migrators")
	require.Equal(t, 1, first, "the stalled migrator applied both: %v", applied)

	again, err := migrate.Up(ctx, postgres.From(s.DB), source())
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
	applied, err := migrate.Up(context.Background(), postgres.From(s.DB), bad)
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

// On either driver's pool (pgx through its stdlib adapter), Pending
// lists what Up would apply and changes nothing; Up leaves the pool open.
func TestPendingListsWhatUpWouldApplyAndChangesNothing(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		s := pgtest.New(t)
		db := s.Handles(t, driver)
		ctx := context.Background()

		pending, err := migrate.Pending(ctx, db, source())
		require.NoError(t, err)
		require.Len(t, pending, 2, "never migrated: everything is pending")
		require.Equal(t, []int{1, 2}, []int{pending[0].Version, pending[1].Version})
		var exists bool
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT to_regclass('millwright_migrations') IS NOT NULL`).Scan(&exists))
		require.False(t, exists, "Pending creates nothing")

		one := migrate.Source{Component: "demo", FS: fstest.MapFS{"001_create.sql": source().FS.(fstest.MapFS)["001_create.sql"]}}
		_, err = migrate.Up(ctx, db, one)
		require.NoError(t, err)
		pending, err = migrate.Pending(ctx, db, source())
		require.NoError(t, err)
		require.Len(t, pending, 1)
		require.Equal(t, "column", pending[0].Name)

		applied, err := migrate.Up(ctx, db, source())
		require.NoError(t, err)
		require.Len(t, applied, 1)
		pending, err = migrate.Pending(ctx, db, source())
		require.NoError(t, err)
		require.Empty(t, pending)
		require.NoError(t, db.PingContext(ctx), "Up leaves the service's pool open")
		require.Equal(t, []string{"name"}, pgtest.Column[string](t, s.DB, `SELECT column_name::text FROM information_schema.columns
			WHERE table_schema = current_schema() AND table_name = 'demo_items' AND column_name = 'name'`))
	})
}

func TestUpRefusesAZeroDB(t *testing.T) {
	t.Parallel()
	_, err := migrate.Up(context.Background(), postgres.DB{}, source())
	require.ErrorIs(t, err, postgres.ErrNoDB)
}

// Migrating into a schema that does not exist names the schema and the
// fix (Postgres' own error, "no schema has been selected to create in",
// names none), creates nothing, and works once the schema exists.
func TestUpNamesTheMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t)
	missing := s.Name + "_missing"
	for name, tc := range map[string]struct {
		path string
		want []string
	}{
		"one schema":   {missing, []string{`schema "` + missing + `" does not exist`, `CREATE SCHEMA "` + missing + `"`, "search_path naming the schema"}},
		"with $user":   {`"$user", ` + missing, []string{`schema "` + missing + `" does not exist`, `CREATE SCHEMA "` + missing + `"`}},
		"two schemas":  {missing + ", " + missing + "_too", []string{"none of the schemas", `CREATE SCHEMA "` + missing + `"`}},
		"quoted comma": {`"` + missing + `,x"`, []string{`schema "` + missing + `,x" does not exist`}},
	} {
		t.Run(name, func(t *testing.T) {
			db, err := sql.Open("postgres", pgtest.WithSearchPath(s.URL, tc.path))
			require.NoError(t, err)
			t.Cleanup(func() { db.Close() })
			_, err = migrate.Up(ctx, postgres.From(db), source())
			require.ErrorIs(t, err, migrate.ErrNoSchema)
			var nse *migrate.NoSchemaError
			require.ErrorAs(t, err, &nse)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), "no schema has been selected", "Postgres' own error names no schema")
		})
	}

	db, err := sql.Open("postgres", pgtest.WithSearchPath(s.URL, missing))
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	_, err = s.DB.ExecContext(ctx, `CREATE SCHEMA `+missing)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.DB.ExecContext(context.Background(), `DROP SCHEMA `+missing+` CASCADE`) })
	applied, err := migrate.Up(ctx, postgres.From(db), source())
	require.NoError(t, err)
	require.Len(t, applied, 2)
	var n int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'demo_items'`, missing).Scan(&n))
	require.Equal(t, 1, n, "the tables land in the schema, once it exists")
}
