package idempotency_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
)

// insertMarks inserts n marks processed age ago.
func insertMarks(t *testing.T, b *pgBundle, prefix string, n int, age time.Duration) {
	t.Helper()
	_, err := b.schema.DB.Exec(`INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
		SELECT 'c', $1 || g, now() - make_interval(secs => $2) FROM generate_series(1, $3) g`,
		prefix, age.Seconds(), n)
	require.NoError(t, err)
}

func TestCleanerDeletesOnlyOldMarksInBatches(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	insertMarks(t, b, "old-", 25, 8*24*time.Hour)
	insertMarks(t, b, "recent-", 5, 6*24*time.Hour)
	insertMarks(t, b, "new-", 5, 0)

	c, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{BatchSize: 10})
	require.NoError(t, err)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, idempotency.CleanStats{Deleted: 25, Batches: 3}, stats)

	require.Equal(t, 10, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`))
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events WHERE event_id LIKE 'old-%'`))

	stats, err = c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, idempotency.CleanStats{}, stats, "nothing left to delete")
}

func TestCleanerSkipsWhileAnotherHoldsTheLock(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	insertMarks(t, b, "old-", 3, 8*24*time.Hour)

	other, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{})
	require.NoError(t, err)
	c, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{})
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
// schema.
func TestCleanerLockIsPerSchema(t *testing.T) {
	t.Parallel()
	a, b := setupPG(t), setupPG(t)
	insertMarks(t, b, "old-", 2, 8*24*time.Hour)
	conn, err := a.schema.DB.Conn(context.Background())
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(context.Background(), `SELECT pg_advisory_lock(1836535877, hashtext(current_schema()))`)
	require.NoError(t, err)

	c, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{})
	require.NoError(t, err)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(2), stats.Deleted)
}

func TestCleanerRunAndClose(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	insertMarks(t, b, "old-", 4, 2*time.Hour)
	c, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{Retention: time.Hour, Interval: 10 * time.Millisecond})
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
	c, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(ctx) }()
	<-c.Running()
	cancel()
	require.NoError(t, <-runErr)
	require.NoError(t, c.Close())

	never, err := idempotency.NewCleaner(b.schema.DB, idempotency.CleanerConfig{})
	require.NoError(t, err)
	require.NoError(t, never.Close(), "Close without Run does not block")
	require.NoError(t, never.Run(context.Background()), "Run after Close returns nil at once")
}

func TestCleanerConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  idempotency.CleanerConfig
		want string
	}{
		{idempotency.CleanerConfig{Retention: time.Second}, "Retention 1s is too short"},
		{idempotency.CleanerConfig{BatchSize: -1}, "BatchSize -1 out of range"},
		{idempotency.CleanerConfig{Interval: time.Millisecond}, "Interval 1ms too short"},
	} {
		_, err := idempotency.NewCleaner(new(sql.DB), tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := idempotency.NewCleaner(nil, idempotency.CleanerConfig{})
	require.ErrorContains(t, err, "db is nil")
}
