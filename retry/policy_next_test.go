package retry

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Next keeps a duration budget whatever the jitter draws: attempts go on
// while less than MaxElapsedTime has passed, each delay ends no later
// than the budget, and the attempt made once it has passed is the last.
func TestPolicy_NextKeepsTheBudget(t *testing.T) {
	t.Parallel()
	p := Policy{InitialInterval: 500 * time.Millisecond, MaxInterval: time.Minute, MaxAttempts: -1, MaxElapsedTime: 15 * time.Minute}
	for range 1000 {
		elapsed := time.Duration(0)
		attempt := 1
		for {
			d, ok := p.Next(attempt, elapsed, 0)
			if !ok {
				break
			}
			require.GreaterOrEqual(t, d, time.Duration(0))
			require.LessOrEqual(t, elapsed+d, p.MaxElapsedTime, "attempt %d's delay ends after the budget", attempt)
			elapsed += d
			attempt++
		}
		require.Equal(t, p.MaxElapsedTime, elapsed, "the last attempt is not at the end of the budget")
	}
	// MaxAttempts, when set, is an extra bound.
	p.MaxAttempts = 3
	_, ok := p.Next(2, 0, 0)
	require.True(t, ok)
	_, ok = p.Next(3, 0, 0)
	require.False(t, ok)
	// Without a budget, Next is Delay and Exhausted.
	q := Policy{InitialInterval: time.Second, MaxInterval: time.Second, Jitter: JitterNone, MaxAttempts: 2}
	d, ok := q.Next(1, time.Hour, 0)
	require.True(t, ok)
	require.Equal(t, time.Second, d)
}
