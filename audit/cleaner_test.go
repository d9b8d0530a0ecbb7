package audit_test

import (
	"context"
	"testing"
	"time"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// newCleaner builds the cleaner on the pool of driver.
func newCleaner(t *testing.T, s *pgtest.Schema, driver string, cfg retention.Config) (*retention.Cleaner, error) {
	t.Helper()
	return retention.NewAuditCleaner(s.Handles(t, driver), cfg)
}

func TestCleanerDeletesRowsOlderThanRetention(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCleanerDeletesRows(t, driver)
	})
}

func testCleanerDeletesRows(t *testing.T, driver string) {
	s := pgtest.New(t, audit.Migrations())
	for _, cmd := range []string{"old", "new"} {
		_, err := audit.Record(context.Background(), postgres.SQL(s.DB), audit.Entry{Command: cmd, Confirmed: "--yes"})
		require.NoError(t, err)
	}
	_, err := s.DB.Exec(`UPDATE millwright_audit SET at = now() - interval '366 days' WHERE command = 'old'`)
	require.NoError(t, err)

	c, err := newCleaner(t, s, driver, retention.Config{})
	require.NoError(t, err)
	require.Equal(t, retention.DefaultAuditRetention, c.Config().Retention)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 1, Batches: 1}, stats)
	entries, err := audit.List(context.Background(), postgres.From(s.DB), 0)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "new", entries[0].Command)

	_, err = retention.NewAuditCleaner(postgres.From(s.DB), retention.Config{Retention: time.Hour})
	require.ErrorContains(t, err, "audit cleaner: retention.Config.Retention 1h0m0s is too short")
}
