package main

import (
	"database/sql"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/outbox"
)

// retryFailed runs `outbox retry-failed`'s change (or, with dry, lists
// it), reporting progress per batch of outbox.RetryBatch rows reset.
func retryFailed(cmd *cobra.Command, db *sql.DB, filter outbox.FailedFilter, dry bool) ([]outbox.FailedEvent, error) {
	ctx := cmd.Context()
	if dry {
		return outbox.RetryFailed(ctx, db, filter, true)
	}
	prog := newProgress(cmd, "outbox retry-failed", "events", 0)
	evs, err := outbox.RetryFailedWithProgress(ctx, db, filter, false, func(done, total int) {
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
