package sql

import (
	"testing"
	"time"
)

// The horizon is re-read an eighth of the wait so far later: within 1 ms
// at first, never later than the poll.
func TestRecheckAfter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ elapsed, poll, want time.Duration }{
		{0, time.Second, time.Millisecond},
		{4 * time.Millisecond, time.Second, time.Millisecond},
		{80 * time.Millisecond, time.Second, 10 * time.Millisecond},
		{time.Minute, time.Second, time.Second},
		{time.Minute, 100 * time.Millisecond, 100 * time.Millisecond},
	} {
		if got := recheckAfter(tc.elapsed, tc.poll); got != tc.want {
			t.Errorf("recheckAfter(%s, %s) = %s, want %s", tc.elapsed, tc.poll, got, tc.want)
		}
	}
}

// A wake that comes while the horizon still hides the notified row is
// remembered: the waker keeps the highest id until a horizon above it.
func TestWakerKeepsTheHighestPendingXid(t *testing.T) {
	t.Parallel()
	w := &waker{ch: make(chan struct{}, 1)}
	w.notify(10)
	w.notify(7)
	w.notify(0) // a reconnection only wakes
	if got := w.pendingXid(); got != 10 {
		t.Fatalf("pending %d, want 10", got)
	}
	w.passed(10)
	if got := w.pendingXid(); got != 10 {
		t.Fatalf("horizon 10 does not pass xid 10: pending %d", got)
	}
	w.passed(11)
	if got := w.pendingXid(); got != 0 {
		t.Fatalf("pending %d after horizon 11", got)
	}
	select {
	case <-w.ch:
	default:
		t.Fatal("no wake pending")
	}
}
