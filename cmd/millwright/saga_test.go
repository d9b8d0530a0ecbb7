package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// runSaga runs `millwright saga args...` against the schema (stdin not a
// terminal) and returns its stdout and stderr.
func runSaga(t *testing.T, url string, args ...string) (string, error) {
	t.Helper()
	stdout, stderr, err := runCLI(t, sagaCmd(), nil, url, args...)
	return stdout + stderr, err
}

func TestSagaCommands(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, current_step, data, version, compensation_attempts, last_error, created_at)
		VALUES ('o-1', 'orders', 'stuck', 1, '{"id":"o-1"}', 9, 3, 'compensation of step "charge_payment" failed (attempt 3): card service down', now() - interval '1 minute'),
		       ('o-2', 'orders', 'completed', 2, '{"id":"o-2"}', 4, 0, NULL, now()),
		       ('i-1', 'invoices', 'running', 0, '{}', 1, 0, NULL, now())`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO millwright_saga_steps (saga_id, step, kind, detail, attempt, error) VALUES
		('o-1', 'reserve_inventory', 'command', 'inventory.reserve.v1', 1, NULL),
		('o-1', 'reserve_inventory', 'reply', 'reserve_inventory.succeeded', 1, NULL),
		('o-1', 'charge_payment', 'command', 'payment.charge.v1', 1, NULL),
		('o-1', 'charge_payment', 'reply', 'charge_payment.failed', 1, 'card declined'),
		('o-1', 'charge_payment', 'compensation', 'payment.refund.v1', 3, NULL),
		('o-1', 'charge_payment', 'stuck', '', 3, 'card service down')`)
	require.NoError(t, err)

	out, err := runSaga(t, s.URL, "list")
	require.NoError(t, err)
	require.Contains(t, out, "o-1")
	require.Contains(t, out, "i-1")

	out, err = runSaga(t, s.URL, "list", "--type", "orders", "--state", "stuck")
	require.NoError(t, err)
	require.Contains(t, out, "o-1")
	require.Contains(t, out, "charge_payment")
	require.NotContains(t, out, "o-2")
	require.NotContains(t, out, "i-1")

	_, err = runSaga(t, s.URL, "list", "--state", "stuk")
	require.ErrorContains(t, err, "want running, compensating, completed, compensated or stuck")

	out, err = runSaga(t, s.URL, "show", "o-1")
	require.NoError(t, err)
	require.Contains(t, out, "state:                  stuck")
	require.Contains(t, out, "card declined")
	require.Contains(t, out, "history (6 entries)")
	require.Contains(t, out, "millwright saga resolve o-1")

	_, err = runSaga(t, s.URL, "show", "nope")
	require.ErrorIs(t, err, saga.ErrNotFound)

	out, err = runSaga(t, s.URL, "resolve", "o-1", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, `dry run: would resend the compensation of step "charge_payment"`)
	in, _, err := saga.Get(context.Background(), postgres.From(s.DB), "o-1")
	require.NoError(t, err)
	require.Equal(t, saga.StateStuck, in.State)

	out, err = runSaga(t, s.URL, "resolve", "o-1", "--action", "skip", "--note", "refunded by hand", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "resolved saga o-1")
	in, h, err := saga.Get(context.Background(), postgres.From(s.DB), "o-1")
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensating, in.State)
	require.Equal(t, 0, in.StepIndex)
	require.Equal(t, "skip: refunded by hand", h[len(h)-1].Detail)

	_, err = runSaga(t, s.URL, "resolve", "o-1", "--yes")
	require.ErrorIs(t, err, saga.ErrNotStuck)
	_, err = runSaga(t, s.URL, "resolve", "o-1", "--action", "undo", "--yes")
	require.ErrorContains(t, err, `unknown action "undo"`)
}
