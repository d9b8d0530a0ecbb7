package relay

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

type testRegistry struct{ *prometheus.Registry }

func newTestRegistry() testRegistry { return testRegistry{prometheus.NewRegistry()} }

// value returns the value of an unlabelled gauge or counter, or the sample
// count of a histogram.
func (r testRegistry) value(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := r.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		switch {
		case m.GetGauge() != nil:
			return m.GetGauge().GetValue()
		case m.GetCounter() != nil:
			return m.GetCounter().GetValue()
		case m.GetHistogram() != nil:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	return -1
}

func TestMetrics_SharedRegistry(t *testing.T) {
	t.Parallel()
	reg := newTestRegistry()
	a, err := newMetrics(reg)
	require.NoError(t, err)
	b, err := newMetrics(reg)
	require.NoError(t, err, "a second relay in the process reuses the collectors")
	a.published.Inc()
	b.published.Inc()
	require.Equal(t, 2.0, reg.value(t, MetricPublished))
}
