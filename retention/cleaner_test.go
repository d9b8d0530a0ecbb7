package retention_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

const bound = 10 * time.Second

var table = retention.Table{
	Component: "test", Rows: "things",
	Store: storage.RetentionTable{
		Name: "things", Key: "id", OrderBy: "id",
		Where:     `done AND at < now() - $1 * interval '1 millisecond'`,
		LockClass: 0x74657374,
	},
	DefaultRetention: time.Hour, MinRetention: time.Millisecond,
}

// setup returns a schema with a things table holding old done rows, old
// rows not done and recent done rows.
func setup(t *testing.T, oldDone int) *pgtest.Schema {
	t.Helper()
	s := pgtest.New(t)
	_, err := s.DB.Exec(`CREATE TABLE things (id BIGSERIAL PRIMARY KEY, done BOOLEAN NOT NULL, at TIMESTAMPTZ NOT NULL)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO things (done, at) SELECT true, now() - interval '2 hours' FROM generate_series(1, $1);
		`, oldDone)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO things (done, at) SELECT false, now() - interval '2 hours' FROM generate_series(1, 3)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO things (done, at) SELECT true, now() FROM generate_series(1, 4)`)
	require.NoError(t, err)
	return s
}

func rows(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM things`).Scan(&n))
	return n
}

func TestRunOnceDeletesOnlyQualifyingRowsInBatches(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testRunOnceDeletes(t, driver)
	})
}

func testRunOnceDeletes(t *testing.T, driver string) {
	s := setup(t, 25)
	c, err := retention.New(s.Pool(t, driver), table, retention.Config{BatchSize: 10})
	require.NoError(t, err)
	ctx := context.Background()

	n, err := c.Count(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 25, n, "the dry run counts what RunOnce deletes")
	require.Equal(t, 32, rows(t, s.DB), "Count changes nothing")

	stats, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 25, Batches: 3}, stats)
	require.Equal(t, 7, rows(t, s.DB), "rows not done and recent rows are kept")

	stats, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{}, stats)
}

func TestRunOnceSkipsWhileAnotherInstanceHoldsTheLockOfItsSchema(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testRunOnceSkips(t, driver)
	})
}

func testRunOnceSkips(t *testing.T, driver string) {
	a, b := setup(t, 3), setup(t, 2)
	ctx := context.Background()
	conn, err := a.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	var locked bool
	require.NoError(t, conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock($1, hashtext(current_schema()))`, table.Store.LockClass).Scan(&locked))
	require.True(t, locked)

	ca, err := retention.New(a.Pool(t, driver), table, retention.Config{})
	require.NoError(t, err)
	stats, err := ca.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Skipped: true}, stats)
	require.Equal(t, 10, rows(t, a.DB))

	cb, err := retention.New(b.Pool(t, driver), table, retention.Config{})
	require.NoError(t, err)
	stats, err = cb.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 2, Batches: 1}, stats, "another schema's cleaner is not excluded")

	_, err = conn.ExecContext(ctx, `SELECT pg_advisory_unlock($1, hashtext(current_schema()))`, table.Store.LockClass)
	require.NoError(t, err)
	stats, err = ca.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, stats.Deleted)
}

// onePool returns a pool of driver with one connection (its backend is
// the cleaner's) and that backend's pid.
func onePool(t *testing.T, s *pgtest.Schema, driver string) (storage.Pool, int) {
	t.Helper()
	var pool storage.Pool
	switch driver {
	case pgtest.DriverPQ:
		db, err := sql.Open("postgres", s.URL)
		require.NoError(t, err)
		db.SetMaxOpenConns(1)
		t.Cleanup(func() { db.Close() })
		pool = storage.NewSQLPool(db)
	case pgtest.DriverPgx:
		cfg, err := pgxpool.ParseConfig(s.URL)
		require.NoError(t, err)
		cfg.MaxConns = 1
		p, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		pool = storage.NewPgxPool(p)
	default:
		t.Fatalf("unknown driver %q", driver)
	}
	var pid int
	require.NoError(t, pool.QueryRow(context.Background(), storage.S(`SELECT pg_backend_pid()`), &pid))
	return pool, pid
}

// blocked starts Run on a cleaner whose first DELETE waits on a table lock
// the test holds, and returns once it waits. release ends the lock.
func blocked(t *testing.T, driver string, cfg retention.Config) (s *pgtest.Schema, c *retention.Cleaner, errc <-chan error, release func()) {
	t.Helper()
	s = setup(t, 10)
	pool, pid := onePool(t, s, driver)

	block, err := s.DB.Begin()
	require.NoError(t, err)
	_, err = block.Exec(`LOCK TABLE things IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	released := false
	release = func() {
		if !released {
			released = true
			require.NoError(t, block.Rollback())
		}
	}
	t.Cleanup(release)

	c, err = retention.New(pool, table, cfg)
	require.NoError(t, err)
	ch := make(chan error, 1)
	go func() { ch <- c.Run(context.Background()) }()
	poll.Until(t, bound, func() bool { return pgtest.WaitingOnLock(t, s.DB, pid) == 1 }, "the cleaner's DELETE waits on the table lock")
	return s, c, ch, release
}

func TestCloseFinishesTheBatchInFlightAndStops(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCloseFinishesTheBatchInFlight(t, driver)
	})
}

func testCloseFinishesTheBatchInFlight(t *testing.T, driver string) {
	s, c, errc, release := blocked(t, driver, retention.Config{BatchSize: 2, Interval: time.Hour})
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case <-c.Draining():
	case <-time.After(bound):
		t.Fatal("Close did not ask Run to drain")
	}
	select {
	case <-closed:
		t.Fatal("Close returned while the batch was in flight")
	default:
	}
	// Draining before the batch ends: the round stops after this one batch
	// instead of deleting all ten rows.
	release()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(bound):
		t.Fatal("Close did not return after the batch finished")
	}
	require.NoError(t, <-errc)
	require.Equal(t, 15, rows(t, s.DB), "one batch of 2 of the 10 old rows deleted, then stopped")
}

func TestCloseCancelsAfterCloseTimeout(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCloseCancelsAfterCloseTimeout(t, driver)
	})
}

func testCloseCancelsAfterCloseTimeout(t *testing.T, driver string) {
	s, c, errc, release := blocked(t, driver, retention.Config{BatchSize: 2, Interval: time.Hour, CloseTimeout: 20 * time.Millisecond})
	require.NoError(t, c.Close(), "returns although the batch is still blocked")
	require.NoError(t, <-errc)
	release()
	require.Equal(t, 17, rows(t, s.DB), "the cancelled batch rolled back whole")
	require.NoError(t, c.Close(), "idempotent")
}

func TestRunCleansUntilClosed(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testRunCleansUntilClosed(t, driver)
	})
}

func testRunCleansUntilClosed(t *testing.T, driver string) {
	s := setup(t, 5)
	c, err := retention.New(s.Pool(t, driver), table, retention.Config{Interval: 5 * time.Millisecond})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	<-c.Running()
	// Rows that become old after the first round are deleted by a later one.
	_, err = s.DB.Exec(`UPDATE things SET at = now() - interval '2 hours' WHERE done`)
	require.NoError(t, err)
	poll.Until(t, bound, func() bool { return rows(t, s.DB) == 3 }, "later rounds delete rows that aged")
	require.NoError(t, c.Close())
	require.NoError(t, <-errc)
}

func TestConfigValidateJoinsEveryFieldError(t *testing.T) {
	t.Parallel()
	_, err := retention.New(nil, table, retention.Config{Retention: time.Microsecond, BatchSize: -1, Interval: time.Microsecond, CloseTimeout: -1})
	require.Error(t, err)
	for _, field := range []string{"test cleaner: retention.Config.Retention", "retention.Config.BatchSize", "retention.Config.Interval", "retention.Config.CloseTimeout"} {
		require.ErrorContains(t, err, field)
	}
	_, err = retention.NewOutboxCleaner(postgres.DB{}, retention.Config{})
	require.ErrorIs(t, err, postgres.ErrNoDB)
	require.ErrorContains(t, err, "NewOutboxCleaner")
	_, err = retention.NewDeadLetterCleaner(postgres.From(new(sql.DB)), retention.Config{Retention: time.Minute})
	require.ErrorContains(t, err, "dlq cleaner: retention.Config.Retention 1m0s is too short: want at least 1h0m0s (default 2160h0m0s)")

	c, err := retention.New(nil, table, retention.Config{})
	require.NoError(t, err, "the defaults are valid")
	require.Equal(t, time.Hour, c.Config().Retention, "the table's default retention")
	for _, tc := range []struct {
		open func(postgres.DB, retention.Config) (*retention.Cleaner, error)
		want time.Duration
	}{
		{retention.NewOutboxCleaner, retention.DefaultOutboxRetention},
		{retention.NewIdempotencyCleaner, retention.DefaultIdempotencyRetention},
		{retention.NewDeadLetterCleaner, retention.DefaultDeadLetterRetention},
		{retention.NewSagaCleaner, retention.DefaultSagaRetention},
		{retention.NewAuditCleaner, retention.DefaultAuditRetention},
	} {
		c, err := tc.open(postgres.From(new(sql.DB)), retention.Config{})
		require.NoError(t, err)
		require.Equal(t, tc.want, c.Config().Retention)
	}
}
