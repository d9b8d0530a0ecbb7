package idempotencybench_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/idempotencybench"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// A small run gives the baseline and both modes with figures, the budget
// on the transactional row only, one JSON object per row, and a verdict.
func TestRun(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, idempotency.Migrations())
	rep, err := idempotencybench.Run(context.Background(), idempotencybench.Config{DB: s.DB, URL: s.URL, Messages: 50, Workers: 2, Rounds: 3})
	require.NoError(t, err)
	require.Len(t, rep.Rows, 6, "three variants on each of pq and pgx")
	for i, r := range rep.Rows {
		require.Equal(t, []string{"pq", "pgx"}[i/3], r.Driver, r)
		if i%3 == 0 {
			require.InDelta(t, 1.0, r.Cost, 1e-9, "the baseline is its own reference")
		}
		require.Positive(t, r.Rate, r)
		require.Positive(t, r.Cost, r)
		require.GreaterOrEqual(t, r.RoundTrips, 1.0, r)
		require.GreaterOrEqual(t, r.P99, r.P50, r)
		require.Equal(t, i%3 == 1, r.Budget == idempotencybench.Budget, r)
	}
	var marks int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_processed_events`).Scan(&marks))
	// Per driver and mode: 3 timed rounds, and the round-trip pass's
	// warm-up and counted run, of 50 messages each.
	require.Equal(t, 2*2*(3+2)*50, marks, "both modes mark every message of every run")

	var js bytes.Buffer
	require.NoError(t, rep.WriteJSON(&js))
	sc := bufio.NewScanner(&js)
	n := 0
	for sc.Scan() {
		var row map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &row), sc.Text())
		require.Equal(t, "idempotency", row["bench"])
		n++
	}
	require.Equal(t, 6, n)
	var table strings.Builder
	require.NoError(t, rep.WriteTable(&table))
	require.Contains(t, table.String(), "middleware transactional costs")
	require.Contains(t, table.String(), "median of 3 rounds")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := idempotencybench.Run(context.Background(), idempotencybench.Config{Workers: -1})
	require.ErrorContains(t, err, "Config.DB and Config.URL are required")
	require.ErrorContains(t, err, "--workers -1")
}
