package main

import (
	"context"
	"slices"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// onlyDriverParam is a URL parameter that one driver consumes and the
// other sends to the server as a setting, which Postgres refuses
// ("unrecognized configuration parameter"): a command given a URL with
// it succeeds only if every connection it makes is of that driver, so a
// command run with it proves it ran on that driver's pool and opened no
// pool of the other.
var onlyDriverParam = map[string]string{
	pgtest.DriverPgx: "pool_max_conns=3",                   // pgxpool's
	pgtest.DriverPQ:  "disable_prepared_binary_result=yes", // lib/pq's
}

// The state-changing commands change the database and write their audit
// row on the pool of --driver, on both drivers, and the read-only
// commands read through it.
func TestOperatorCommandsOnEveryDriver(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		s := seedForEveryChange(t)
		url := s.URL + "&" + onlyDriverParam[driver]
		run := func(root func() *cobra.Command, args ...string) (string, error) {
			t.Helper()
			cmd := root()
			addDriverFlag(cmd)
			stdout, stderr, err := runCLI(t, cmd, nil, url, append(args, "--driver", driver)...)
			return stdout + stderr, err
		}
		lastAudit := func(command string, affected int64) audit.Entry {
			t.Helper()
			rows := auditRows(t, s)
			require.NotEmpty(t, rows)
			e := rows[0]
			require.Equal(t, command, e.Command)
			require.Equal(t, affected, e.Affected, "%s: rows affected", command)
			require.Equal(t, "--yes", e.Confirmed)
			require.False(t, e.DryRun)
			require.Empty(t, e.Error)
			require.Contains(t, e.Args, "--driver="+driver)
			return e
		}

		// The URL is the driver's own: the other driver cannot connect
		// with it, and a run refused so writes nothing.
		other := pgtest.DriverPQ
		if driver == pgtest.DriverPQ {
			other = pgtest.DriverPgx
		}
		cmd := outboxCmd()
		addDriverFlag(cmd)
		_, _, err := runCLI(t, cmd, nil, url, "retry-failed", "--yes", "--driver", other)
		require.ErrorContains(t, err, "unrecognized configuration parameter")
		require.Empty(t, auditRows(t, s))

		out, err := run(dlqCmd, "replay", "--all", "--transport", "mem://", "--rate", "0", "--yes")
		require.NoError(t, err, out)
		require.Contains(t, out, "queued 3 message(s)")
		require.Zero(t, pendingDeadLetters(t, dlq.NewStore(postgres.From(s.DB))), "every dead letter marked replayed")
		lastAudit("dlq replay", 3)

		out, err = run(sagaCmd, "resolve", "o-1", "--action", "skip", "--note", "refunded by hand", "--yes")
		require.NoError(t, err, out)
		require.Contains(t, out, "resolved saga o-1 (type orders)")
		in, hist, err := saga.Get(ctx, postgres.From(s.DB), "o-1")
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensating, in.State, "skip goes on with the earlier steps' compensations")
		require.NotEmpty(t, hist)
		require.Equal(t, saga.KindResolved, hist[len(hist)-1].Kind)
		require.Equal(t, "skip: refunded by hand", hist[len(hist)-1].Detail)
		lastAudit("saga resolve", 1)

		out, err = run(outboxCmd, "retry-failed", "--yes")
		require.NoError(t, err, out)
		require.Contains(t, out, "3 failed event(s) back to pending")
		var failed, pending int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FILTER (WHERE status = 'failed'),
			count(*) FILTER (WHERE status = 'pending' AND retry_count = 0 AND event_id LIKE 'e-%') FROM millwright_outbox`).Scan(&failed, &pending))
		require.Zero(t, failed)
		require.Equal(t, 3, pending, "the failed rows are pending with a fresh budget")
		lastAudit("outbox retry-failed", 3)

		out, err = run(idempotencyCmd, "clean", "--yes")
		require.NoError(t, err, out)
		require.Contains(t, out, "deleted 5 processed marks")
		lastAudit("idempotency clean", 5)

		// A dry run refused for a flag writes nothing; a valid one only its
		// audit row.
		rows := len(auditRows(t, s))
		_, err = run(sagaCmd, "resolve", "o-1", "--dry-run", "--action", "undo")
		require.ErrorContains(t, err, "--action")
		_, err = run(cleanAllCmd, "--dry-run", "--dlq-retention", "1m")
		require.ErrorContains(t, err, "too short")
		require.Len(t, auditRows(t, s), rows, "invalid dry runs wrote no audit row")
		out, err = run(outboxCmd, "retry-failed", "--dry-run")
		require.NoError(t, err, out)
		require.Contains(t, out, "dry run: 0 failed event(s) would be retried")
		got := auditRows(t, s)
		require.Len(t, got, rows+1)
		require.True(t, got[0].DryRun)

		// The read-only commands.
		for _, c := range []struct {
			root func() *cobra.Command
			args []string
			want string
		}{
			{dlqCmd, []string{"list", "--topic", "invoices"}, "failure number 2"},
			{dlqCmd, []string{"show", "1"}, "original topic:"},
			{sagaCmd, []string{"list", "--state", "compensating"}, "o-1"},
			{sagaCmd, []string{"show", "o-1"}, "skip: refunded by hand"},
			{sagaCmd, []string{"versions"}, "orders"},
			{outboxCmd, []string{"status"}, "(all)"},
			{idempotencyCmd, []string{"stats"}, "CONSUMER"},
			{auditCmd, []string{"list"}, "saga resolve"},
		} {
			out, err := run(c.root, c.args...)
			require.NoError(t, err, "%v: %s", c.args, out)
			require.Contains(t, out, c.want, "%v", c.args)
		}
		require.True(t, slices.ContainsFunc(auditRows(t, s), func(e audit.Entry) bool { return e.Command == "outbox retry-failed" }))
	})
}
