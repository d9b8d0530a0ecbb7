package googlecloud

import "time"

// SetStallBound makes subscribers opened after it treat d, not
// RedeliveryBound, as the stall threshold, checked every 100ms.
func SetStallBound(d time.Duration) {
	stallBound.Store(int64(d))
	stallCheckEvery.Store(int64(100 * time.Millisecond))
}
