package main

import (
	"regexp"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// Every bench reports its progress in runs (done/total) on stderr and
// ends with the summary line; tiny sizes, gochannel only.
func TestEveryBenchReportsProgress(t *testing.T) { // not parallel: the global rootCmd
	if testing.Short() {
		t.Skip("runs every benchmark, tiny")
	}
	// The benches with constructors run in a fresh tree: slice flags set
	// by an earlier run of the global tree would add to these.
	fresh := &cobra.Command{Use: "millwright-bench", SilenceUsage: true, SilenceErrors: true}
	addDriverFlag(fresh)
	fresh.AddCommand(benchIdempotencyCmd(), benchOutboxCmd(), benchSagaCmd())
	for _, tc := range []struct {
		args []string
		runs string
	}{
		{[]string{"idempotency", "--messages", "20", "--workers", "1", "--rounds", "1"}, "6/6"}, // 3 variants on pq and pgx,
		{[]string{"transport", "--kinds", "gochannel", "--publishers", "1", "--messages", "20", "--runs", "1"}, "2/2"},
		{[]string{"relay-memory", "--pending", "10,20"}, "2/2"},
		{[]string{"outbox", "--sections", "write", "--writes", "10", "--rounds", "1", "--kinds", "gochannel"}, "1/1"},
		{[]string{"saga", "--kinds", "gochannel", "--sagas", "5", "--latency-sagas", "0", "--rounds", "1", "--ceiling", "0", "--shapes", "linear"}, "2/2"}, // on pq and pgx,
	} {
		name := "millwright-bench " + tc.args[0]
		root := rootCmd // transport and relay-memory: only there
		if c, _, err := fresh.Find(tc.args); err == nil && c != fresh {
			root = fresh
		}
		_, stderr, err := runCLI(t, root, nil, pgtest.BaseURL(), tc.args...)
		require.NoError(t, err, "%v: %s", tc.args, stderr)
		require.Regexp(t, `(?m)^`+regexp.QuoteMeta(name)+`: done, `+tc.runs+` runs \(100%\) in [^ ]+ \([0-9.]+/s\)$`, stderr, "%v", tc.args)
	}
}
