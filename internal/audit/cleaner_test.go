package audit_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// newCleaner builds the cleaner on the pool of driver: the generic
// constructor, instantiated for *sql.DB or *pgxpool.Pool.
func newCleaner(t *testing.T, s *pgtest.Schema, driver string, cfg cleaner.Config) (*cleaner.Cleaner, error) {
	t.Helper()
	switch h := s.Handle(t, driver).(type) {
	case *sql.DB:
		return audit.NewCleaner(postgres.From(h), cfg)
	case *pgxpool.Pool:
		return audit.NewCleaner(postgres.From(h), cfg)
	}
	t.Fatalf("no pool for driver %s", driver)
	return nil, nil
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
		_, err := audit.Record(context.Background(), s.DB, audit.Entry{Command: cmd, Confirmed: "--yes"})
		require.NoError(t, err)
	}
	_, err := s.DB.Exec(`UPDATE millwright_audit SET at = now() - interval '366 days' WHERE command = 'old'`)
	require.NoError(t, err)

	c, err := newCleaner(t, s, driver, cleaner.Config{})
	require.NoError(t, err)
	require.Equal(t, audit.DefaultRetention, c.Config().Retention)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, cleaner.Stats{Deleted: 1, Batches: 1}, stats)
	entries, err := audit.List(context.Background(), s.DB, 0)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "new", entries[0].Command)

	_, err = audit.NewCleaner(postgres.From(s.DB), cleaner.Config{Retention: time.Hour})
	require.ErrorContains(t, err, "audit: CleanerConfig.Retention 1h0m0s is too short")
}
