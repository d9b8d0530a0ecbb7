package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// TopicStats is the backlog of one topic, for `millwright outbox status`.
type TopicStats struct {
	Topic            string
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
}

// ReadTopicStats returns the pending and failed counts per topic, reading
// only pending and failed rows (through their partial indexes).
func ReadTopicStats(ctx context.Context, db postgres.Handle) ([]TopicStats, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: ReadTopicStats: %w", err)
	}
	st, err := storage.ReadOutboxTopicStats(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading per-topic stats%s: %w", storage.Hint(err), err)
	}
	out := make([]TopicStats, len(st))
	for i, s := range st {
		out[i] = TopicStats(s)
	}
	return out, nil
}

// FailedFilter selects failed rows for RetryFailed. Empty fields match all.
type FailedFilter struct {
	// Topic limits the retry to one topic.
	Topic string
	// IDs limits the retry to these row ids.
	IDs []int64
}

// FailedEvent describes one failed row.
type FailedEvent struct {
	ID          int64
	EventID     string
	Topic       string
	AggregateID string
	RetryCount  int
	LastError   string
	CreatedAt   time.Time
}

// RetryFailed puts the failed rows matching f back to pending with a fresh
// retry budget, and wakes listening relays; with dryRun it only lists them.
// It returns the rows concerned. Rows go back in id order within their
// aggregate; note that later events of the aggregate may have been
// published meanwhile (see the package documentation). While Debezium
// capture is on (SwitchToDebezium until SwitchToRelay) it refuses, dry run
// included, with an error wrapping ErrCaptureActive that names the fix:
// the connector streams inserts only and would never send the row.
func RetryFailed(ctx context.Context, db postgres.DB, f FailedFilter, dryRun bool) ([]FailedEvent, error) {
	return RetryFailedWithProgress(ctx, db, f, dryRun, nil)
}

// RetryBatch is how many rows RetryFailedWithProgress resets per UPDATE.
const RetryBatch = 1000

// RetryFailedWithProgress is RetryFailed calling progress, if not nil,
// with the rows selected (total) once they are locked and then after each
// UPDATE of at most RetryBatch rows with the rows reset so far. Every batch
// is in the one transaction, committed at the end: a run stopped midway
// changes nothing.
func RetryFailedWithProgress(ctx context.Context, db postgres.DB, f FailedFilter, dryRun bool, progress func(done, total int)) ([]FailedEvent, error) {
	var out []FailedEvent
	err := db.InTx(ctx, func(tx postgres.Tx) error {
		var err error
		out, err = RetryFailedTx(ctx, tx, f, RetryOptions{DryRun: dryRun, Progress: progress})
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// RetryOptions are RetryFailedTx's options.
type RetryOptions struct {
	// DryRun lists the rows and changes nothing.
	DryRun bool
	// Progress, if not nil, is called with the rows selected (total) once
	// they are locked, then after each UPDATE of at most RetryBatch rows
	// with the rows reset so far.
	Progress func(done, total int)
}

// RetryFailedTx is RetryFailed in tx, the caller's transaction: the
// operator console adds its audit row to it, so the reset and its record
// commit together. It locks the rows it resets; the caller commits (the
// relays, woken by a NOTIFY sent at commit, then publish them). While
// Debezium capture is on it refuses with an error wrapping
// ErrCaptureActive, dry run included. After an error, roll tx back.
func RetryFailedTx(ctx context.Context, tx postgres.Tx, f FailedFilter, opts RetryOptions) ([]FailedEvent, error) {
	q, err := storage.FromTx(tx)
	if err != nil {
		return nil, fmt.Errorf("outbox: RetryFailedTx: %w", err)
	}
	progress := opts.Progress
	if progress == nil {
		progress = func(int, int) {}
	}
	if opts.DryRun {
		// The change itself checks again (storage.ResetFailedEvents).
		if err := storage.CheckCaptureOff(ctx, q, "retry-failed"); err != nil {
			return nil, fmt.Errorf("outbox: %w", err)
		}
	}
	var ids []int64
	if len(f.IDs) > 0 {
		ids = f.IDs
	}
	rows, err := storage.ListFailedEvents(ctx, q, f.Topic, ids, !opts.DryRun)
	if err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: listing failed rows%s: %w", storage.Hint(err), err)
	}
	out := make([]FailedEvent, len(rows))
	sel := make([]int64, len(rows))
	for i, e := range rows {
		out[i] = FailedEvent{ID: e.ID, EventID: e.EventID, Topic: e.Topic, AggregateID: e.AggID, RetryCount: e.RetryCount, LastError: e.LastError, CreatedAt: e.CreatedAt}
		sel[i] = e.ID
	}
	if len(out) == 0 {
		out = nil
	}
	if opts.DryRun || len(sel) == 0 {
		return out, nil
	}
	progress(0, len(sel))
	for start := 0; start < len(sel); start += RetryBatch {
		batch := sel[start:min(start+RetryBatch, len(sel))]
		if _, err := storage.ResetFailedEvents(ctx, q, batch); err != nil {
			if errors.Is(err, storage.ErrCaptureActive) {
				return nil, fmt.Errorf("outbox: %w", err)
			}
			return nil, fmt.Errorf("outbox: retry-failed: resetting %d row(s) (%d of %d done, none committed): %w", len(batch), start, len(sel), err)
		}
		progress(start+len(batch), len(sel))
	}
	if err := storage.NotifyOutboxRelays(ctx, q); err != nil {
		return nil, fmt.Errorf("outbox: retry-failed: notifying relays: %w", err)
	}
	return out, nil
}

// Overview is the state of an outbox at one instant, as the operator
// console shows it.
type Overview struct {
	// Pending, OldestPendingAge and Failed are the totals.
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
	// Topics is the backlog per topic, by topic.
	Topics []TopicBacklog
	// Relays are the relays that announce themselves, by id.
	Relays []RelayInfo
	// Lanes are the 64 lanes, by lane.
	Lanes []LaneInfo
	// Problems are the failed and retrying rows (ReadProblems).
	Problems []ProblemEvent
}

// TopicBacklog is the backlog of one topic.
type TopicBacklog struct {
	Topic                     string
	Pending, Retrying, Failed int64
	OldestPendingAge          time.Duration
}

// RelayInfo is one relay as it announces itself.
type RelayInfo struct {
	ID        string
	SeenUntil time.Time
	// Load is the relay's own report of its load.
	Load string
	// Live is true while its announcement has not expired.
	Live bool
}

// LaneInfo is one lane's lease.
type LaneInfo struct {
	Lane       int
	Owner      string
	LeaseUntil time.Time
	// Lent is true for a lane lent to Owner by the relay whose share it is.
	Lent bool
	// Held is true while the lease runs.
	Held bool
}

// ReadOverview reads the outbox's Overview, with at most problems failed
// and problems retrying rows (problems must be positive). In the caller's
// transaction (the operator console's, in its schema) it is one snapshot.
func ReadOverview(ctx context.Context, db postgres.Handle, problems int) (Overview, error) {
	var o Overview
	if problems <= 0 {
		return o, fmt.Errorf("outbox: ReadOverview: problems %d: want at least 1", problems)
	}
	q, err := storage.FromHandle(db)
	if err != nil {
		return o, fmt.Errorf("outbox: ReadOverview: %w", err)
	}
	st, err := storage.ReadOutboxStats(ctx, q)
	if err != nil {
		return o, fmt.Errorf("outbox: reading the outbox%s: %w", storage.Hint(err), err)
	}
	o.Pending, o.OldestPendingAge, o.Failed = st.Pending, st.OldestPendingAge, st.Failed
	backlog, err := storage.ReadOutboxBacklog(ctx, q)
	if err != nil {
		return o, fmt.Errorf("outbox: reading the backlog per topic: %w", err)
	}
	for _, b := range backlog {
		o.Topics = append(o.Topics, TopicBacklog(b))
	}
	relays, err := storage.ReadOutboxRelays(ctx, q)
	if err != nil {
		return o, fmt.Errorf("outbox: reading the relays: %w", err)
	}
	for _, r := range relays {
		o.Relays = append(o.Relays, RelayInfo(r))
	}
	lanes, err := storage.ReadOutboxLanes(ctx, q)
	if err != nil {
		return o, fmt.Errorf("outbox: reading the lanes: %w", err)
	}
	for _, l := range lanes {
		o.Lanes = append(o.Lanes, LaneInfo(l))
	}
	if o.Problems, err = readProblems(ctx, q, problems); err != nil {
		return o, err
	}
	return o, nil
}

// LiveRelays counts the relays whose announcement on db's outbox has not
// expired: whether events queued now (a dead letter's replay, say) will be
// published without waiting for one to start.
func LiveRelays(ctx context.Context, db postgres.Handle) (int, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return 0, fmt.Errorf("outbox: LiveRelays: %w", err)
	}
	relays, err := storage.ReadOutboxRelays(ctx, q)
	if err != nil {
		return 0, fmt.Errorf("outbox: reading the relays%s: %w", storage.Hint(err), err)
	}
	n := 0
	for _, r := range relays {
		if r.Live {
			n++
		}
	}
	return n, nil
}
