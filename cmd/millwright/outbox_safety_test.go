package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

func TestOutboxRetryFailedSafety(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		SELECT 'e-' || g, 'orders', 'o-' || g, '{}', 'failed', 10, 'broker said no' FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	failed := func() (n int) {
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE status = 'failed'`).Scan(&n))
		return n
	}

	_, _, err = runCLI(t, outboxCmd(), nil, s.URL, "retry-failed")
	require.ErrorIs(t, err, errNeedsYes)

	out, _, err := runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run: 3 failed event(s) would be retried")
	require.Equal(t, 3, failed())

	out, _, err = runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "3 failed event(s) back to pending")
	require.Equal(t, 0, failed())

	rows, err := audit.List(context.Background(), postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.Equal(t, "outbox retry-failed", rows[0].Command)
	require.EqualValues(t, 3, rows[0].Affected)
	require.False(t, rows[0].DryRun)
	require.EqualValues(t, 3, rows[1].Affected)
	require.True(t, rows[1].DryRun)
}

// retry-failed of thousands of rows reports progress per batch of
// outbox.RetryBatch on stderr, then its summary.
func TestOutboxRetryFailedProgress(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), audit.Migrations())
	_, err := s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		SELECT 'e-' || g, 'orders', 'o-' || g, '{}', 'failed', 10, 'broker said no' FROM generate_series(1, 2500) g`)
	require.NoError(t, err)

	out, stderr, err := runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--yes")
	require.NoError(t, err, stderr)
	require.Contains(t, out, "2500 failed event(s) back to pending")
	require.Regexp(t, `(?m)^outbox retry-failed: 1000/2500 events \(40%\), [0-9.]+/s, about .* left`, stderr)
	require.Regexp(t, `(?m)^outbox retry-failed: 2000/2500 events \(80%\)`, stderr)
	require.Regexp(t, `(?m)^outbox retry-failed: done, 2500/2500 events \(100%\) in [^ ]+ \([0-9.]+/s\); committed$`, stderr)
}
