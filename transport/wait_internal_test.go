package transport

import (
	"testing"
	"time"
)

// Open's wait doubles from 0.5s to at most 5s, jittered below that bound.
func TestWaitDelayBounds(t *testing.T) {
	t.Parallel()
	bounds := []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second, 5 * time.Second}
	for i, bound := range bounds {
		attempt := i + 1
		var most time.Duration
		for range 2000 {
			d := waitDelay(attempt)
			if d < 0 || d > bound {
				t.Fatalf("waitDelay(%d) = %s: want 0..%s", attempt, d, bound)
			}
			most = max(most, d)
		}
		if most < bound/2 {
			t.Errorf("waitDelay(%d): the longest of 2000 delays is %s, want close to %s (full jitter)", attempt, most, bound)
		}
	}
	if d := waitDelay(1 << 30); d > 5*time.Second {
		t.Errorf("waitDelay(huge attempt) = %s: want at most 5s", d)
	}
}
