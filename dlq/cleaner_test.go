package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// newCleaner builds the cleaner on the pool of driver.
func newCleaner(t *testing.T, s *pgtest.Schema, driver string, cfg retention.Config) (*retention.Cleaner, error) {
	t.Helper()
	return retention.NewDeadLetterCleaner(s.Handles(t, driver), cfg)
}

func TestCleanerDeletesDeadLettersOlderThanRetentionReplayedOrNot(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCleanerDeletesDeadLetters(t, driver)
	})
}

func testCleanerDeletesDeadLetters(t *testing.T, driver string) {
	store, s := newStore(t)
	now := time.Now()
	ids := insert(t, store,
		deadLetter("orders", "old, replayed", now), deadLetter("orders", "old, pending", now),
		deadLetter("orders", "recent", now))
	_, err := s.DB.Exec(`UPDATE millwright_dead_letters SET created_at = now() - interval '91 days' WHERE id = ANY($1)`,
		pq.Array(ids[:2]))
	require.NoError(t, err)
	_, err = s.DB.Exec(`UPDATE millwright_dead_letters SET replayed_at = now() WHERE id = $1`, ids[0])
	require.NoError(t, err)

	c, err := newCleaner(t, s, driver, retention.Config{})
	require.NoError(t, err)
	require.Equal(t, retention.DefaultDeadLetterRetention, c.Config().Retention)
	n, err := c.Count(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 2, Batches: 1}, stats)
	var left []int64
	rows, err := s.DB.Query(`SELECT id FROM millwright_dead_letters`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id int64
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []int64{ids[2]}, left)

	plan := pgtest.Plan(t, s.DB, `SELECT id FROM millwright_dead_letters WHERE created_at < now() - interval '90 days' ORDER BY created_at LIMIT 1000`)
	require.Contains(t, plan, "millwright_dead_letters_created_idx", "the batch walks the index of migration 002")

	_, err = retention.NewDeadLetterCleaner(postgres.From(s.DB), retention.Config{Retention: time.Minute})
	require.ErrorContains(t, err, "dlq cleaner: retention.Config.Retention 1m0s is too short")
}
