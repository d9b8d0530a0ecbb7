package main

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/outbox"
)

// retryFailed runs `outbox retry-failed`'s change (or, with dry, lists
// it) on the command's pool, reporting progress per batch of
// outbox.RetryBatch rows reset.
func retryFailed(cmd *cobra.Command, pool *cliPool, filter outbox.FailedFilter, dry bool) ([]outbox.FailedEvent, error) {
	ctx := cmd.Context()
	if dry {
		return retryFailedOn(ctx, pool, filter, true, nil)
	}
	prog := newProgress(cmd, "outbox retry-failed", "events", 0)
	evs, err := retryFailedOn(ctx, pool, filter, false, func(done, total int) {
		prog.SetTotal(int64(total))
		prog.Set(int64(done))
	})
	if err != nil {
		// Whether the one transaction committed or not, a re-run selects
		// only the rows still failed.
		prog.Stopped(stoppedBy(ctx, err), "re-running is safe: the batches are one transaction, and rows back to pending are not selected again")
		return nil, err
	}
	prog.Finish("committed")
	return evs, nil
}

// retryFailedOn is outbox.RetryFailedWithProgress on the command's pool
// (--driver); progress may be nil.
func retryFailedOn(ctx context.Context, pool *cliPool, filter outbox.FailedFilter, dry bool, progress func(done, total int)) ([]outbox.FailedEvent, error) {
	return outbox.RetryFailedWithProgress(ctx, pool.handle(), filter, dry, progress)
}
