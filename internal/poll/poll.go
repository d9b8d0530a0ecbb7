// Package poll waits in tests for state that another goroutine, connection
// or process changes, by checking a condition until it holds.
package poll

import (
	"fmt"
	"testing"
	"time"
)

// Interval is how often Until checks its condition.
const Interval = 5 * time.Millisecond

// Until calls cond on the test's goroutine (so cond may use require) until
// it returns true, and fails the test when it still does not after within;
// format and args name what was awaited.
func Until(t testing.TB, within time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s: %s", within, fmt.Sprintf(format, args...))
		}
		time.Sleep(Interval)
	}
}
