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

// SetWakeHooks sets the hooks an idle consume loop of t runs before it
// tries its table's wake-up lock and after it found it held, before it
// looks at the table (nil: none).
func SetWakeHooks(t *Transport, beforeLock, beforeLook func(table uint32)) {
	if beforeLock == nil {
		t.notify.beforeLock.Store(nil)
	} else {
		t.notify.beforeLock.Store(&beforeLock)
	}
	if beforeLook == nil {
		t.notify.beforeLook.Store(nil)
	} else {
		t.notify.beforeLook.Store(&beforeLook)
	}
}

// StopWakeups stops t's wake-up listener (and gives its locks back) as
// Close does after its subscriptions, while they still run.
func StopWakeups(t *Transport) { t.notify.stop() }

// LockLosses counts the wake-up lock sessions t's check found lost (0
// without a listener).
func LockLosses(t *Transport) int64 {
	if t.notify == nil {
		return 0
	}
	return t.notify.lockLosses.Load()
}

// StaleSessionsEnded counts the silent wake-up lock sessions t ended from
// its next connection.
func StaleSessionsEnded(t *Transport) int64 {
	if t.notify == nil {
		return 0
	}
	return t.notify.locks.ended.Load()
}
