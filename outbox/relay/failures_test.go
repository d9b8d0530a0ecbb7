package relay

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A run of failures is logged once, then once per failureLogEvery with the
// count since and the wait, then once when it ends; the waits grow to the
// cap and stay within it.
func TestFailures_LogOncePerIntervalWithTheCount(t *testing.T) {
	t.Parallel()
	log := &countingLogger{}
	f := newFailures(log, 30*time.Second)
	clock := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	f.now = func() time.Time { return clock }
	boom := errors.New("connection refused")

	var waits []time.Duration
	for range 101 { // 101 failures 100ms apart: 10s from the first to the last
		waits = append(waits, f.failed("outbox relay: batch failed", boom))
		clock = clock.Add(100 * time.Millisecond)
	}
	lines := log.since(0)
	require.Len(t, lines, 2, "want the first failure and one line after %s; got:\n%s", failureLogEvery, strings.Join(lines, "\n"))
	require.Contains(t, lines[0], "retrying in ")
	require.Contains(t, lines[0], "connection refused")
	require.Contains(t, lines[1], "100 more failure(s) in the last 10s")
	require.Contains(t, lines[1], "retrying in ")
	for i, w := range waits {
		require.LessOrEqual(t, w, failureMax, "wait %d", i)
		require.Positive(t, w, "wait %d", i)
	}
	require.GreaterOrEqual(t, waits[len(waits)-1], failureMax/2, "equal jitter at the cap draws from [max/2, max]")
	require.LessOrEqual(t, waits[0], failureInitial)

	f.ok("outbox relay")
	lines = log.since(2)
	require.Len(t, lines, 1)
	require.Contains(t, lines[0], "working again after 101 failed attempt(s)")
	f.ok("outbox relay") // nothing to end: silent
	require.Equal(t, 3, log.count())
	// A new run starts over: logged at once, from the initial backoff.
	require.LessOrEqual(t, f.failed("outbox relay: batch failed", boom), failureInitial)
	require.Equal(t, 4, log.count())
}

// A short lease caps the backoff at a third of it, so that a relay whose
// claim failed still renews its lanes in time.
func TestFailureBackoff_CappedByTheLease(t *testing.T) {
	t.Parallel()
	p := failureBackoff(300 * time.Millisecond)
	require.Equal(t, 100*time.Millisecond, p.MaxInterval)
	require.Equal(t, failureMax, failureBackoff(30*time.Second).MaxInterval)
	require.Equal(t, laneCheckEvery, failureBackoff(time.Millisecond).MaxInterval, "a tiny lease must not make the relay spin")
}
