package main

import (
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
)

// seedExpired puts two rows past the default retention and one within it
// into every table millwright cleans.
func seedExpired(t *testing.T, s *pgtest.Schema) {
	t.Helper()
	_, err := s.DB.Exec(`
		INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, published_at)
			SELECT 'e-' || g, 't', 'a', '{}', 'published', now() - make_interval(days => CASE WHEN g < 3 THEN 8 ELSE 0 END)
			FROM generate_series(1, 3) g;
		INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
			SELECT 'c', 'e-' || g, now() - make_interval(days => CASE WHEN g < 3 THEN 8 ELSE 0 END) FROM generate_series(1, 3) g;
		INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, first_failure_at, last_failure_at, payload, created_at)
			SELECT 'm-' || g, 't', 't.dlq', now(), now(), '', now() - make_interval(days => CASE WHEN g < 3 THEN 91 ELSE 0 END)
			FROM generate_series(1, 3) g;
		INSERT INTO millwright_saga_instances (id, type, state, data, updated_at)
			SELECT 's-' || g, 'orders', 'completed', '{}', now() - make_interval(days => CASE WHEN g < 3 THEN 31 ELSE 0 END)
			FROM generate_series(1, 3) g;
		INSERT INTO millwright_audit (at, os_user, hostname, command, dry_run, confirmed, affected)
			SELECT now() - make_interval(days => CASE WHEN g < 3 THEN 366 ELSE 0 END), 'u', 'h', 'x', false, '--yes', 0
			FROM generate_series(1, 3) g`)
	require.NoError(t, err)
}

func tableCounts(t *testing.T, s *pgtest.Schema) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, table := range []string{"millwright_outbox", "millwright_processed_events", "millwright_dead_letters", "millwright_saga_instances", "millwright_audit"} {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM `+table).Scan(&n))
		out[table] = n
	}
	return out
}

func TestCleanAllCountsThenDeletesEveryTableAndAudits(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), dlq.Migrations(), saga.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	seedExpired(t, s)
	all3 := map[string]int{"millwright_outbox": 3, "millwright_processed_events": 3, "millwright_dead_letters": 3, "millwright_saga_instances": 3, "millwright_audit": 3}

	out, _, err := runCLI(t, cleanAllCmd(), nil, s.URL, "--dry-run")
	require.NoError(t, err)
	for _, want := range []string{
		"would delete 2 published outbox events older than 168h0m0s",
		"would delete 2 processed marks older than 168h0m0s",
		"would delete 2 dead letters older than 2160h0m0s",
		"would delete 2 completed and compensated sagas (with their steps) older than 720h0m0s",
		"would delete 2 audit rows older than 8760h0m0s",
	} {
		require.Contains(t, out, want)
	}
	all3["millwright_audit"]++ // the dry run's own audit row
	require.Equal(t, all3, tableCounts(t, s), "a dry run deletes nothing")

	out, stderr, err := runCLI(t, cleanAllCmd(), nil, s.URL, "--yes", "--batch-size", "1", "--saga-retention", "1000h")
	require.NoError(t, err)
	// Progress on stderr (not a terminal: a line per tenth, each batch of
	// one row of the 8 being more), then the summary.
	require.Regexp(t, `(?m)^clean: 4/8 rows \(50%\), [0-9.]+/s, about .* left`, stderr)
	require.Regexp(t, `(?m)^clean: done, 8/8 rows \(100%\) in `, stderr)
	require.Contains(t, out, "deleted 2 published outbox events in 2 batches")
	require.Contains(t, out, "deleted 0 completed and compensated sagas (with their steps) in 0 batches", "--saga-retention 1000h keeps 31-day-old sagas")
	require.Equal(t, map[string]int{
		"millwright_outbox": 1, "millwright_processed_events": 1, "millwright_dead_letters": 1, "millwright_saga_instances": 3,
		"millwright_audit": 3, // one recent seed, the dry run's row, this run's row
	}, tableCounts(t, s))

	rows := auditRows(t, s)
	require.Equal(t, "clean", rows[0].Command)
	require.EqualValues(t, 8, rows[0].Affected, "2 rows of each of four tables")
	require.EqualValues(t, 10, rows[1].Affected, "the dry run counted 2 rows of each of five tables")
	require.True(t, rows[1].DryRun)
}

func TestComponentCleanCommands(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), dlq.Migrations(), saga.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	seedExpired(t, s)
	for _, tc := range []struct {
		root  func() *cobra.Command
		table string
		rows  string
	}{
		{outboxCmd, "millwright_outbox", "published outbox events"},
		{dlqCmd, "millwright_dead_letters", "dead letters"},
		{sagaCmd, "millwright_saga_instances", "completed and compensated sagas (with their steps)"},
		{auditCmd, "millwright_audit", "audit rows"},
	} {
		out, _, err := runCLI(t, tc.root(), nil, s.URL, "clean", "--yes")
		require.NoError(t, err, tc.table)
		require.Contains(t, out, "deleted 2 "+tc.rows+" in 1 batches")
	}
	counts := tableCounts(t, s)
	require.Equal(t, 1, counts["millwright_outbox"])
	require.Equal(t, 1, counts["millwright_dead_letters"])
	require.Equal(t, 1, counts["millwright_saga_instances"])
	require.Equal(t, 3, counts["millwright_processed_events"], "only the named component is cleaned")

	_, _, err := runCLI(t, dlqCmd(), nil, s.URL, "clean", "--yes", "--retention", "1m")
	require.ErrorContains(t, err, "dlq cleaner: retention.Config.Retention 1m0s is too short")
}
