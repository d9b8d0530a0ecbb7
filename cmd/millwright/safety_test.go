package main

import (
	"bytes"
	"context"
	"io"
	"strconv"
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

// fakeTTY is stdin that says it is a terminal, with the operator's answer.
type fakeTTY struct{ io.Reader }

func (fakeTTY) IsTerminal() bool { return true }

// runCLI runs a command tree with stdin in (nil: not a terminal, empty) and
// --database-url on every subcommand, returning stdout and stderr.
func runCLI(t *testing.T, root *cobra.Command, in io.Reader, dbURL string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errOut bytes.Buffer
	if in == nil {
		in = strings.NewReader("")
	}
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetIn(in)
	root.SetArgs(args)
	var setURL func(c *cobra.Command)
	setURL = func(c *cobra.Command) {
		if c.Flags().Lookup("database-url") != nil {
			require.NoError(t, c.Flags().Set("database-url", dbURL))
		}
		for _, sub := range c.Commands() {
			setURL(sub)
		}
	}
	setURL(root)
	err = root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

// auditRows returns the audit rows of command runs, newest first: not
// the rows the operator actions write per item in their transaction (a
// replayed dead letter's "dlq replay", see itemAuditRows).
func auditRows(t *testing.T, s *pgtest.Schema) []audit.Entry {
	t.Helper()
	rows, err := audit.List(context.Background(), postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	var out []audit.Entry
	for _, r := range rows {
		if !itemCommand(r.Command) {
			out = append(out, r)
		}
	}
	return out
}

// itemAuditRows returns the audit rows the operator actions wrote per
// item, newest first, as "command args...".
func itemAuditRows(t *testing.T, s *pgtest.Schema) []string {
	t.Helper()
	rows, err := audit.List(context.Background(), postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	var out []string
	for _, r := range rows {
		if itemCommand(r.Command) {
			out = append(out, strings.Join(append([]string{r.User, r.Command}, r.Args...), " "))
		}
	}
	return out
}

// itemCommand reports the audit commands of the rows written per item.
func itemCommand(c string) bool {
	return c == dlq.ReplayCommand || c == dlq.EditReplayCommand || c == dlq.ResolveCommand
}

func pendingDeadLetters(t *testing.T, store *dlq.Store) int {
	t.Helper()
	n, err := store.Count(context.Background(), dlq.Filter{Pending: true})
	require.NoError(t, err)
	return n
}

func TestStateChangingCommandsRefuseWithoutYesOffTerminal(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), saga.Migrations(), idempotency.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	seedDeadLetters(t, store)
	// Something for each command to change: a stuck saga, expired
	// idempotency marks and failed outbox rows.
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, current_step, data, version, compensation_attempts, last_error)
		VALUES ('o-1', 'orders', 'stuck', 1, '{}', 3, 3, 'refund failed')`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
		SELECT 'billing', 'old-' || g, now() - interval '30 days' FROM generate_series(1, 5) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		SELECT 'e-' || g, 'orders', 'o-' || g, '{}', 'failed', 10, 'broker said no' FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	before := tableContents(t, s)
	require.Contains(t, before["millwright_saga_instances"], "stuck")
	require.Equal(t, 5, strings.Count(before["millwright_processed_events"], "old-"))
	require.Equal(t, 3, strings.Count(before["millwright_outbox"], "broker said no"))

	for _, tc := range []struct {
		root *cobra.Command
		args []string
	}{
		{dlqCmd(), []string{"replay", "--all", "--transport", "mem://"}},
		{sagaCmd(), []string{"resolve", "o-1"}},
		{idempotencyCmd(), []string{"clean"}},
		{outboxCmd(), []string{"retry-failed"}},
		{outboxCmd(), []string{"clean"}},
		{dlqCmd(), []string{"clean"}},
		{sagaCmd(), []string{"clean"}},
		{auditCmd(), []string{"clean"}},
		{cleanAllCmd(), nil},
	} {
		_, _, err := runCLI(t, tc.root, nil, s.URL, tc.args...)
		require.ErrorIs(t, err, errNeedsYes, "%v", tc.args)
		require.ErrorContains(t, err, "pass --yes")
	}
	require.Equal(t, 3, pendingDeadLetters(t, store), "nothing replayed")
	require.Equal(t, before, tableContents(t, s), "a refused run changes nothing")
	require.Empty(t, auditRows(t, s), "a refused run changes nothing and is not a run")
}

// tableContents returns every row of the tables the state-changing
// commands write, as text, per table.
func tableContents(t *testing.T, s *pgtest.Schema) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, table := range []string{"millwright_dead_letters", "millwright_saga_instances", "millwright_saga_steps",
		"millwright_processed_events", "millwright_outbox"} {
		var rows string
		require.NoError(t, s.DB.QueryRow(`SELECT coalesce(string_agg(r::text, E'\n' ORDER BY r::text), '') FROM `+table+` r`).Scan(&rows))
		out[table] = rows
	}
	return out
}

func TestDLQReplayAuditsCountsAndDryRunChangesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	seedDeadLetters(t, store)

	out, stderr, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "would queue 3 message(s)")
	require.Contains(t, stderr, "audited as millwright_audit row")
	require.Equal(t, 3, pendingDeadLetters(t, store), "dry run marked nothing")
	rows := auditRows(t, s)
	require.Len(t, rows, 1)
	require.True(t, rows[0].DryRun)
	require.Equal(t, "dry-run", rows[0].Confirmed)
	require.EqualValues(t, 3, rows[0].Affected)
	require.Equal(t, "dlq replay", rows[0].Command)
	require.Contains(t, rows[0].Args, "--all=true")
	require.NotEmpty(t, rows[0].User)
	require.NotEmpty(t, rows[0].Host)

	out, _, err = runCLI(t, dlqCmd(), nil, s.URL, "replay", "--topic", "orders", "--transport", "mem://", "--rate", "0", "--yes")
	require.NoError(t, err, out)
	require.Contains(t, out, "queued 2 message(s)")
	require.Equal(t, 1, pendingDeadLetters(t, store))
	rows = auditRows(t, s)
	require.Len(t, rows, 2)
	require.False(t, rows[0].DryRun)
	require.Equal(t, "--yes", rows[0].Confirmed)
	require.EqualValues(t, 2, rows[0].Affected)
	require.Contains(t, rows[0].Args, "--topic=orders")
	require.Empty(t, rows[0].Error)

	require.Equal(t, []string{audit.CurrentUser() + " replay dead letter --id=2", audit.CurrentUser() + " replay dead letter --id=1"}, itemAuditRows(t, s),
		"each replayed dead letter has its own row, written with it")

	// A run refused for a flag writes nothing, not even an audit row.
	_, _, err = runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--since", "yesterday", "--yes")
	require.ErrorContains(t, err, "--since")
	require.Len(t, auditRows(t, s), 2)

	// A failing run is audited with its error and what it did: here the
	// outbox table is gone, so nothing can be queued.
	_, err = s.DB.Exec(`DROP TABLE millwright_outbox`)
	require.NoError(t, err)
	_, _, err = runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--yes")
	require.ErrorContains(t, err, "millwright migrate")
	rows = auditRows(t, s)
	require.Len(t, rows, 3)
	require.EqualValues(t, 0, rows[0].Affected)
	require.NotEmpty(t, rows[0].Error)
	require.Equal(t, 1, pendingDeadLetters(t, store))
}

func TestConfirmationPromptOnTerminal(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	ids := seedDeadLetters(t, store)

	_, stderr, err := runCLI(t, dlqCmd(), fakeTTY{strings.NewReader("n\n")}, s.URL, "replay", "--all", "--transport", "mem://")
	require.ErrorIs(t, err, ErrNotConfirmed)
	require.Contains(t, stderr, "would queue 3 message(s)", "the prompt shows what will change")
	require.Contains(t, stderr, "Proceed? [y/N]")
	require.Equal(t, 3, pendingDeadLetters(t, store))

	_, _, err = runCLI(t, dlqCmd(), fakeTTY{strings.NewReader("")}, s.URL, "replay", "--all", "--transport", "mem://")
	require.ErrorIs(t, err, ErrNotConfirmed, "end of input is no")
	require.Empty(t, auditRows(t, s))

	out, _, err := runCLI(t, dlqCmd(), fakeTTY{strings.NewReader("yes\n")}, s.URL, "replay", "--id", strconv.FormatInt(ids[0], 10), "--id", strconv.FormatInt(ids[1], 10), "--transport", "mem://", "--rate", "0")
	require.NoError(t, err, out)
	rows := auditRows(t, s)
	require.Len(t, rows, 1)
	require.Equal(t, "prompt", rows[0].Confirmed)
	require.EqualValues(t, 2, rows[0].Affected)
}

func TestSagaResolveAudited(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, current_step, data, version, compensation_attempts, last_error)
		VALUES ('o-1', 'orders', 'stuck', 1, '{}', 3, 3, 'refund failed')`)
	require.NoError(t, err)

	_, _, err = runCLI(t, sagaCmd(), nil, s.URL, "resolve", "o-1", "--dry-run")
	require.NoError(t, err)
	in, _, err := saga.Get(context.Background(), postgres.From(s.DB), "o-1")
	require.NoError(t, err)
	require.Equal(t, saga.StateStuck, in.State, "dry run changed nothing")

	_, _, err = runCLI(t, sagaCmd(), nil, s.URL, "resolve", "o-1", "--yes", "--note", "after the fix")
	require.NoError(t, err)
	_, _, err = runCLI(t, sagaCmd(), nil, s.URL, "resolve", "o-1", "--yes")
	require.ErrorIs(t, err, saga.ErrNotStuck)

	rows := auditRows(t, s)
	require.Len(t, rows, 3)
	require.True(t, rows[2].DryRun)
	require.EqualValues(t, 1, rows[2].Affected)
	require.False(t, rows[1].DryRun)
	require.EqualValues(t, 1, rows[1].Affected)
	require.Equal(t, []string{"o-1", "--note=after the fix", "--yes=true"}, withoutDatabaseURL(rows[1].Args))
	require.EqualValues(t, 0, rows[0].Affected)
	require.Contains(t, rows[0].Error, "not stuck")

	out, _, err := runCLI(t, auditCmd(), nil, s.URL, "list")
	require.NoError(t, err)
	require.Equal(t, 4, strings.Count(out, "\n"), "header and three rows:\n%s", out)
	require.Contains(t, out, "saga resolve")
}

func withoutDatabaseURL(args []string) []string {
	var out []string
	for _, a := range args {
		if !strings.HasPrefix(a, "--database-url=") {
			out = append(out, a)
		}
	}
	return out
}

func TestIdempotencyCleanAuditsDeletedCount(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, idempotency.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_processed_events (consumer, event_id, processed_at)
		SELECT 'billing', 'old-' || g, now() - interval '30 days' FROM generate_series(1, 5) g
		UNION ALL SELECT 'billing', 'new-' || g, now() FROM generate_series(1, 2) g`)
	require.NoError(t, err)
	count := func() (n int) {
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_processed_events`).Scan(&n))
		return n
	}

	out, _, err := runCLI(t, idempotencyCmd(), nil, s.URL, "clean", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "would delete 5 processed marks")
	require.Equal(t, 7, count())

	out, _, err = runCLI(t, idempotencyCmd(), nil, s.URL, "clean", "--yes", "--batch-size", "2")
	require.NoError(t, err)
	require.Contains(t, out, "deleted 5 processed marks in 3 batches")
	require.Equal(t, 2, count())

	rows := auditRows(t, s)
	require.Len(t, rows, 2)
	require.Equal(t, "idempotency clean", rows[0].Command)
	require.EqualValues(t, 5, rows[0].Affected)
	require.False(t, rows[0].DryRun)
	require.EqualValues(t, 5, rows[1].Affected)
	require.True(t, rows[1].DryRun)
}

func TestNoChangeWithoutAuditTable(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := dlq.NewStore(postgres.From(s.DB))
	seedDeadLetters(t, store)
	_, _, err := runCLI(t, dlqCmd(), nil, s.URL, "replay", "--all", "--transport", "mem://", "--yes")
	require.ErrorIs(t, err, audit.ErrNotMigrated)
	require.Equal(t, 3, pendingDeadLetters(t, store))
}
