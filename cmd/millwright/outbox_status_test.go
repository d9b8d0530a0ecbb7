package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
)

// `outbox status` shows the failed events and the ones retrying, with
// their last error (otherwise only in the table), a bounded number of each.
func TestOutboxStatusShowsFailedAndRetryingEventsWithTheirLastError(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	_, err := s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error) VALUES
		('e-old', 'orders', 'o-1', '{}', 'failed', 10, 'old failure'),
		('e-new', 'orders', 'o-2', '{}', 'failed', 1, 'kafka: message too large: over topic orders''s max.message.bytes'),
		('e-retry', 'payments', 'p-1', '{}', 'pending', 7, 'broker unreachable'),
		('e-fine', 'payments', 'p-2', '{}', 'pending', 0, NULL)`)
	require.NoError(t, err)

	out, _, err := runCLI(t, outboxCmd(), nil, s.URL, "status")
	require.NoError(t, err)
	for _, want := range []string{"failed and retrying events", "e-new", "message too large", "e-old", "old failure", "e-retry", "retrying", "broker unreachable"} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, "e-fine", "a row without failed attempts is no problem")

	out, _, err = runCLI(t, outboxCmd(), nil, s.URL, "status", "--problems", "1")
	require.NoError(t, err)
	require.Contains(t, out, "e-new", "the most recent failed event")
	require.NotContains(t, out, "old failure", "bounded: one failed event")
	require.Contains(t, out, "e-retry")

	out, _, err = runCLI(t, outboxCmd(), nil, s.URL, "status", "--json")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var total struct {
		Topic    string `json:"topic"`
		Problems []struct {
			EventID   string `json:"event_id"`
			Status    string `json:"status"`
			Attempts  int    `json:"attempts"`
			LastError string `json:"last_error"`
		} `json:"problems"`
	}
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &total))
	require.Equal(t, "*", total.Topic)
	require.Len(t, total.Problems, 3)
	require.Equal(t, "e-new", total.Problems[0].EventID)
	require.Equal(t, "failed", total.Problems[0].Status)
	require.Equal(t, "retrying", total.Problems[2].Status)
	require.Equal(t, 7, total.Problems[2].Attempts)
	require.Equal(t, "broker unreachable", total.Problems[2].LastError)

	out, _, err = runCLI(t, outboxCmd(), nil, s.URL, "status", "--problems", "0")
	require.NoError(t, err)
	require.NotContains(t, out, "e-new")
}
