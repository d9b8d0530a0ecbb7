package stats

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestMedian(t *testing.T) {
	t.Parallel()
	require.Zero(t, Median(nil))
	require.Equal(t, 2.0, Median([]float64{3, 1, 2}))
	require.Equal(t, 2.5, Median([]float64{4, 1, 3, 2}))
	xs := []float64{3, 1, 2}
	Median(xs)
	require.Equal(t, []float64{3, 1, 2}, xs, "Median must not sort its argument")
}

func TestPercentile(t *testing.T) {
	t.Parallel()
	xs := make([]float64, 100)
	for i := range xs {
		xs[i] = float64(100 - i) // 100..1
	}
	require.Equal(t, 50.0, Percentile(xs, 50))
	require.Equal(t, 99.0, Percentile(xs, 99))
	require.Equal(t, 100.0, Percentile(xs, 100))
	require.Equal(t, 7.0, Percentile([]float64{7}, 99))
	require.Zero(t, Percentile(nil, 99))
	require.Equal(t, []float64{1.5, 2}, Millis([]time.Duration{1500 * time.Microsecond, 2 * time.Millisecond}))
}
