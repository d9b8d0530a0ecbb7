// Package stats holds the one statistic millwright's benchmarks report
// for repeated rounds, the median, the percentiles of latency samples, and
// their --json output.
// The median, not the best or the mean: on a shared machine one round
// that ran beside someone else's load moves a mean and a best-of, not the
// median.
package stats

import (
	"encoding/json"
	"io"
	"slices"
	"time"
)

// Median returns the median of xs (the mean of the two middle values for
// an even count), 0 for none. xs is not modified.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := len(s) / 2
	if len(s)%2 == 1 {
		return s[m]
	}
	return (s[m-1] + s[m]) / 2
}

// Percentile returns the p-th percentile (0 < p <= 100) of xs by the
// nearest-rank method, 0 for none. xs is not modified.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// Millis returns ds in milliseconds.
func Millis(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d) / float64(time.Millisecond)
	}
	return out
}

// WriteJSON writes rows as one JSON object per line, the --json output
// of every benchmark.
func WriteJSON[T any](w io.Writer, rows []T) error {
	enc := json.NewEncoder(w)
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}
