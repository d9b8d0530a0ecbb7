package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/saga"
)

func TestSagaShowBranchesLine(t *testing.T) {
	t.Parallel()
	due := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	got := branchesLine(map[string]saga.BranchInfo{
		"ship":   {State: saga.BranchRunning, Deadline: due},
		"charge": {State: saga.BranchFailed},
		"points": {State: saga.BranchTimedOut, LateSuccess: true},
	})
	require.Equal(t, "charge=failed, points=timed_out (succeeded late), ship=running (due 2026-12-06T10:00:00Z)", got)
}
