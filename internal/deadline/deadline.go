// Package deadline answers whether a context's deadline has passed, by the
// clock rather than by ctx.Err alone.
package deadline

import (
	"context"
	"time"
)

// Passed reports whether ctx has ended, or its deadline has passed. A call
// that compares the deadline with the clock itself (a dial fails with "i/o
// timeout" as soon as it passes) can fail on it before the context's own
// timer has ended ctx, while ctx.Err is still nil (seen on a loaded
// machine: a connection attempt under a spent deadline was reported as
// connect_timeout's, and the orders demo's give-up as "after 0s").
func Passed(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}
