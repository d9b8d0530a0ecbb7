package sql

// HorizonChecks counts the horizon monitor's finished checks (0 when it is
// disabled), so tests wait for checks instead of sleeping.
func HorizonChecks(t *Transport) int64 {
	if t.mon == nil {
		return 0
	}
	return t.mon.checks.Load()
}

// Waits counts the waits its subscribers began (0 without a listener):
// once it grows after the wake-up lock is taken, the loop waits with it.
func Waits(t *Transport) int64 {
	if t.notify == nil {
		return 0
	}
	return t.notify.waits.Load()
}

// WakeCounts returns the wake-up listener's reconnections, and the
// queries its subscribers ran on a notification and on the poll's expiry
// (all 0 without a listener).
func WakeCounts(t *Transport) (reconnects, wakes, polls int64) {
	if t.notify == nil {
		return 0, 0, 0
	}
	return t.notify.reconnects.Load(), t.notify.wakes.Load(), t.notify.polls.Load()
}
