package main

import (
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// seedForEveryChange gives each state-changing command something to
// change: dead letters, a stuck saga, expired idempotency marks, failed
// and old published outbox rows.
func seedForEveryChange(t *testing.T) *pgtest.Schema {
	t.Helper()
	s := pgtest.New(t, dlq.Migrations(), saga.Migrations(), idempotency.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	seedDeadLetters(t, dlq.NewStore(postgres.From(s.DB)))
	for _, q := range []string{
		`INSERT INTO millwright_saga_instances (id, type, state, current_step, data, version, compensation_attempts, last_error)
			VALUES ('o-1', 'orders', 'stuck', 1, '{}', 3, 3, 'refund failed')`,
		`INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
			SELECT 'billing', 'old-' || g, now() - interval '30 days' FROM generate_series(1, 5) g`,
		`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
			SELECT 'e-' || g, 'orders', 'o-' || g, '{}', 'failed', 10, 'broker said no' FROM generate_series(1, 3) g`,
		`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, created_at, published_at)
			SELECT 'p-' || g, 'orders', 'o-' || g, '{}', 'published', now() - interval '30 days', now() - interval '30 days' FROM generate_series(1, 4) g`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err, q)
	}
	return s
}

// Every command with --dry-run validates all its flags before writing
// anything: an invalid dry run fails and writes no audit row (`clean
// --dry-run --dlq-retention 1m` wrote its row before failing validation),
// and a valid one writes exactly its audit row and nothing else.
func TestDryRunValidatesFirstAndWritesOnlyItsAuditRow(t *testing.T) {
	t.Parallel()
	s := seedForEveryChange(t)
	before := tableContents(t, s)
	require.Equal(t, 3, strings.Count(before["millwright_outbox"], "broker said no"))

	type run struct {
		root func() *cobra.Command
		args []string
		want string // in the error of an invalid run
	}
	invalid := []run{
		{cleanAllCmd, []string{"--dry-run", "--dlq-retention", "1m"}, "Retention 1m0s is too short"},
		{cleanAllCmd, []string{"--dry-run", "--batch-size", "-1"}, "BatchSize -1 out of range"},
		{outboxCmd, []string{"clean", "--dry-run", "--retention", "1us"}, "too short"},
		{dlqCmd, []string{"clean", "--dry-run", "--retention", "1ms"}, "too short"},
		{sagaCmd, []string{"clean", "--dry-run", "--retention", "1ms"}, "too short"},
		{auditCmd, []string{"clean", "--dry-run", "--retention", "1ms"}, "too short"},
		{idempotencyCmd, []string{"clean", "--dry-run", "--batch-size", "1000000"}, "out of range"},
		{dlqCmd, []string{"replay", "--all", "--dry-run", "--rate", "-1"}, "--rate"},
		{dlqCmd, []string{"replay", "--all", "--dry-run", "--since", "yesterday"}, "--since"},
		{sagaCmd, []string{"resolve", "o-1", "--dry-run", "--action", "undo"}, "--action"},
		{outboxCmd, []string{"retry-failed", "--dry-run", "--id", "x"}, "--id"},
	}
	for _, r := range invalid {
		_, _, err := runCLI(t, r.root(), nil, s.URL, r.args...)
		require.ErrorContains(t, err, r.want, "%v", r.args)
		require.Empty(t, auditRows(t, s), "invalid dry run %v wrote an audit row", r.args)
		require.Equal(t, before, tableContents(t, s), "invalid dry run %v changed a table", r.args)
	}

	valid := []run{
		{cleanAllCmd, []string{"--dry-run"}, ""},
		{outboxCmd, []string{"clean", "--dry-run"}, ""},
		{dlqCmd, []string{"clean", "--dry-run"}, ""},
		{sagaCmd, []string{"clean", "--dry-run"}, ""},
		{auditCmd, []string{"clean", "--dry-run"}, ""},
		{idempotencyCmd, []string{"clean", "--dry-run"}, ""},
		{dlqCmd, []string{"replay", "--all", "--dry-run"}, ""},
		{dlqCmd, []string{"replay", "--all", "--dry-run", "--transport", "mem://"}, ""},
		{sagaCmd, []string{"resolve", "o-1", "--dry-run", "--action", "skip"}, ""},
		{outboxCmd, []string{"retry-failed", "--dry-run"}, ""},
	}
	for i, r := range valid {
		_, stderr, err := runCLI(t, r.root(), nil, s.URL, r.args...)
		require.NoError(t, err, "%v: %s", r.args, stderr)
		rows := auditRows(t, s)
		require.Len(t, rows, i+1, "valid dry run %v writes exactly one audit row", r.args)
		require.True(t, rows[0].DryRun, "%v", r.args)
		require.Empty(t, rows[0].Error, "%v", r.args)
		require.Equal(t, before, tableContents(t, s), "valid dry run %v changed a table", r.args)
	}
}
