package outbox

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// The relay's metrics pass the linter `promtool check metrics` runs
// (client_golang's promlint): no gauge named like a histogram's _count.
func TestRelayMetricsPassLint(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	m.latency.Observe(0.01) // a histogram shows its series once observed
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems)
}
