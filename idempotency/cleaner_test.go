package idempotency_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// insertMarks inserts n marks processed age ago.
func insertMarks(t *testing.T, b *pgBundle, prefix string, n int, age time.Duration) {
	t.Helper()
	_, err := b.schema.DB.Exec(`INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
		SELECT 'c', $1 || g, now() - make_interval(secs => $2) FROM generate_series(1, $3) g`,
		prefix, age.Seconds(), n)
	require.NoError(t, err)
}

// newCleaner builds the cleaner on the pool of driver.
func newCleaner(t *testing.T, s *pgtest.Schema, driver string, cfg retention.Config) (*retention.Cleaner, error) {
	t.Helper()
	return retention.NewIdempotencyCleaner(s.Handles(t, driver), cfg)
}

func TestCleanerDeletesOnlyOldMarksInBatches(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCleanerDeletesOnlyOldMarks(t, driver)
	})
}

func testCleanerDeletesOnlyOldMarks(t *testing.T, driver string) {
	b := setupPG(t)
	insertMarks(t, b, "old-", 25, 8*24*time.Hour)
	insertMarks(t, b, "recent-", 5, 6*24*time.Hour)
	insertMarks(t, b, "new-", 5, 0)

	c, err := newCleaner(t, b.schema, driver, retention.Config{BatchSize: 10})
	require.NoError(t, err)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 25, Batches: 3}, stats)

	require.Equal(t, 10, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`))
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events WHERE event_id LIKE 'old-%'`))

	stats, err = c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{}, stats, "nothing left to delete")
}

func TestCleanerSkipsWhileAnotherHoldsTheLock(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	insertMarks(t, b, "old-", 3, 8*24*time.Hour)

	other, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{})
	require.NoError(t, err)
	c, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{})
	require.NoError(t, err)

	// Hold the cleaner's lock the way a running cleaner does, on its own session.
	conn, err := b.schema.DB.Conn(context.Background())
	require.NoError(t, err)
	defer conn.Close()
	var locked bool
	require.NoError(t, conn.QueryRowContext(context.Background(),
		`SELECT pg_try_advisory_lock(1836535877, hashtext(current_schema()))`).Scan(&locked))
	require.True(t, locked)

	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.True(t, stats.Skipped)
	require.Equal(t, 3, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`))

	_, err = conn.ExecContext(context.Background(), `SELECT pg_advisory_unlock(1836535877, hashtext(current_schema()))`)
	require.NoError(t, err)
	stats, err = other.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(3), stats.Deleted)
}

// Cleaners of different schemas do not exclude each other: the lock is per
// schema. A cleaner of schema A holds its lock the way it does in
// production, mid-run: its DELETE waits on a table lock this test holds.
// Meanwhile a second cleaner of A skips and a cleaner of B does its work.
func TestCleanerLockIsPerSchema(t *testing.T) {
	t.Parallel()
	a, b := setupPG(t), setupPG(t)
	insertMarks(t, a, "old-", 3, 8*24*time.Hour)
	insertMarks(t, b, "old-", 2, 8*24*time.Hour)

	block, err := a.schema.DB.Begin()
	require.NoError(t, err)
	_, err = block.Exec(`LOCK TABLE millwright_processed_events IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	holderDB, err := sql.Open("postgres", a.schema.URL)
	require.NoError(t, err)
	holderDB.SetMaxOpenConns(1) // one connection: its backend pid identifies the holder's session
	t.Cleanup(func() { holderDB.Close() })
	var holderPID int
	require.NoError(t, holderDB.QueryRow(`SELECT pg_backend_pid()`).Scan(&holderPID))
	holder, err := retention.NewIdempotencyCleaner(postgres.From(holderDB), retention.Config{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = block.Rollback() }) // before holderDB.Close, which waits for the DELETE
	type result struct {
		stats retention.Stats
		err   error
	}
	held := make(chan result, 1)
	go func() {
		stats, err := holder.RunOnce(ctx)
		held <- result{stats, err}
	}()

	eventually(t, "schema A's cleaner holds its lock and waits on the table", func() bool {
		return pgtest.WaitingOnLock(t, a.schema.DB, holderPID) == 1
	})

	otherA, err := retention.NewIdempotencyCleaner(postgres.From(a.schema.DB), retention.Config{})
	require.NoError(t, err)
	stats, err := otherA.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Skipped: true}, stats, "a second cleaner of schema A skips")

	c, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{})
	require.NoError(t, err)
	stats, err = c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 2, Batches: 1}, stats, "schema B's cleaner is not excluded by A's")
	select {
	case r := <-held:
		t.Fatalf("schema A's cleaner finished while its table was locked: %+v, %v", r.stats, r.err)
	default:
	}

	require.NoError(t, block.Rollback())
	select {
	case r := <-held:
		require.NoError(t, r.err)
		require.Equal(t, retention.Stats{Deleted: 3, Batches: 1}, r.stats)
	case <-time.After(10 * time.Second):
		t.Fatal("schema A's cleaner did not finish within 10s of the table lock's release")
	}
}

func TestCleanerRunAndClose(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	insertMarks(t, b, "old-", 4, 2*time.Hour)
	c, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{Retention: time.Hour, Interval: 10 * time.Millisecond})
	require.NoError(t, err)

	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(context.Background()) }()
	<-c.Running()
	eventually(t, "the cleaner deletes the old marks", func() bool {
		return countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`) == 0
	})
	require.NoError(t, c.Close())
	require.NoError(t, <-runErr)
	require.NoError(t, c.Close(), "Close is idempotent")
	require.NoError(t, c.Run(context.Background()), "Run after Close returns at once")
}

func TestCleanerRunStopsWithContext(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	c, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(ctx) }()
	<-c.Running()
	cancel()
	require.NoError(t, <-runErr)
	require.NoError(t, c.Close())

	never, err := retention.NewIdempotencyCleaner(postgres.From(b.schema.DB), retention.Config{})
	require.NoError(t, err)
	require.NoError(t, never.Close(), "Close without Run does not block")
	require.NoError(t, never.Run(context.Background()), "Run after Close returns nil at once")
}

func TestCleanerConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  retention.Config
		want string
	}{
		{retention.Config{Retention: time.Second}, "Retention 1s is too short"},
		{retention.Config{BatchSize: -1}, "BatchSize -1 out of range"},
		{retention.Config{Interval: time.Microsecond}, "Interval 1µs too short"},
		{retention.Config{Retention: time.Second, BatchSize: -1}, "BatchSize -1 out of range"}, // every field error, joined
	} {
		_, err := retention.NewIdempotencyCleaner(postgres.From(new(sql.DB)), tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := retention.NewIdempotencyCleaner(postgres.From((*sql.DB)(nil)), retention.Config{})
	require.ErrorIs(t, err, postgres.ErrNoDB)
}
