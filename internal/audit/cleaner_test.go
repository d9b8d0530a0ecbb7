package audit_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/pgtest"
)

func TestCleanerDeletesRowsOlderThanRetention(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, audit.Migrations())
	for _, cmd := range []string{"old", "new"} {
		_, err := audit.Record(context.Background(), s.DB, audit.Entry{Command: cmd, Confirmed: "--yes"})
		require.NoError(t, err)
	}
	_, err := s.DB.Exec(`UPDATE millwright_audit SET at = now() - interval '366 days' WHERE command = 'old'`)
	require.NoError(t, err)

	c, err := audit.NewCleaner(s.DB, cleaner.Config{})
	require.NoError(t, err)
	require.Equal(t, audit.DefaultRetention, c.Config().Retention)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, cleaner.Stats{Deleted: 1, Batches: 1}, stats)
	entries, err := audit.List(context.Background(), s.DB, 0)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "new", entries[0].Command)

	_, err = audit.NewCleaner(s.DB, cleaner.Config{Retention: time.Hour})
	require.ErrorContains(t, err, "audit: CleanerConfig.Retention 1h0m0s is too short")
}
