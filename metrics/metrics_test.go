package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metrics"
)

func TestRegisterReusesTheSameCollector(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	opts := prometheus.CounterOpts{Name: "x_total", Help: "x"}
	first, err := metrics.Register(reg, prometheus.NewCounterVec(opts, []string{"a"}))
	require.NoError(t, err)
	second, err := metrics.Register(reg, prometheus.NewCounterVec(opts, []string{"a"}))
	require.NoError(t, err)
	require.Same(t, first, second, "the second registration reuses the first collector")

	// The same name with other labels is a conflict, reported.
	var errs error
	metrics.Into(reg, prometheus.NewCounterVec(opts, []string{"b"}), &errs)
	require.Error(t, errs)
}
