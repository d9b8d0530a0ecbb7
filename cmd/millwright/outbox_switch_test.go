package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// The switch to Debezium and back is a command with a dry run (issue 40
// item 3: docs told operators to call internal functions), and
// retry-failed is refused while capture is on (item 4). No connector:
// the relay's part is played by marking the row published.
func TestOutboxSwitchCommands(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), audit.Migrations())
	slot := "cli_" + s.Name
	t.Cleanup(func() {
		q := storage.NewSQLPool(s.DB)
		_ = storage.DropCaptureSlot(context.Background(), q, slot)
		_ = storage.DisableCapture(context.Background(), q, slot)
	})
	_, err := s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		VALUES ('p', 'orders', 'o-1', '{}', 'pending', 1, 'broker said no'), ('f', 'orders', 'o-2', '{}', 'failed', 10, 'broker said no')`)
	require.NoError(t, err)
	triggers := func() (n int) {
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM pg_trigger WHERE tgname = 'millwright_outbox_capture' AND tgrelid = 'millwright_outbox'::regclass`).Scan(&n))
		return n
	}
	flags := []string{"--slot", slot, "--publication", slot}

	_, _, err = runCLI(t, outboxCmd(), nil, s.URL, "switch-to-debezium", "--dry-run")
	require.ErrorContains(t, err, "--slot and --publication are required")
	out, stderr, err := runCLI(t, outboxCmd(), nil, s.URL, append([]string{"switch-to-debezium", "--dry-run"}, flags...)...)
	require.NoError(t, err, stderr)
	require.Contains(t, out, "to do: create the capture trigger")
	require.Contains(t, out, "to do: create replication slot")
	require.Contains(t, out, "pending rows from before the slot (the relays' to publish): 1")
	require.Zero(t, triggers(), "a dry run changes nothing")

	out, stderr, err = runCLI(t, outboxCmd(), nil, s.URL, append([]string{"switch-to-debezium", "--yes"}, flags...)...)
	require.NoError(t, err, stderr)
	require.Contains(t, out, "pending rows from before the slot (the relays' to publish): 1")
	require.NotContains(t, out, "ready")
	require.Contains(t, out, "next: keep the relays running")
	require.Equal(t, 1, triggers())

	_, _, err = runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--dry-run")
	require.ErrorIs(t, err, outbox.ErrCaptureActive)
	_, _, err = runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--yes")
	require.ErrorIs(t, err, outbox.ErrCaptureActive)
	require.ErrorContains(t, err, "switch-to-relay --slot "+slot)

	_, err = s.DB.Exec(`UPDATE millwright_outbox SET status = 'published' WHERE event_id = 'p'`) // the relay published it
	require.NoError(t, err)
	out, stderr, err = runCLI(t, outboxCmd(), nil, s.URL, append([]string{"switch-to-debezium", "--yes", "--wait", "1m"}, flags...)...)
	require.NoError(t, err, stderr)
	require.Contains(t, out, "nothing to change")
	require.Contains(t, out, "ready")

	out, stderr, err = runCLI(t, outboxCmd(), nil, s.URL, append([]string{"switch-to-relay", "--dry-run"}, flags...)...)
	require.NoError(t, err, stderr)
	require.Contains(t, out, "to do: drop replication slot")
	require.Equal(t, 1, triggers())
	out, stderr, err = runCLI(t, outboxCmd(), nil, s.URL, append([]string{"switch-to-relay", "--yes"}, flags...)...)
	require.NoError(t, err, stderr)
	require.Contains(t, out, "done: drop the capture trigger")
	require.Zero(t, triggers())
	out, _, err = runCLI(t, outboxCmd(), nil, s.URL, "retry-failed", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "1 failed event(s) back to pending")

	rows, err := audit.List(context.Background(), postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	var cmds []string
	for _, r := range rows {
		cmds = append(cmds, r.Command)
	}
	require.Contains(t, cmds, "outbox switch-to-debezium")
	require.Contains(t, cmds, "outbox switch-to-relay")
}
