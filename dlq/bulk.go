package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// StateDiscarded is the state of a dead letter an operator gave up on
// (BulkDiscard): it leaves the dead ones and is never replayed, not even
// with Force (dlq migration 007).
const StateDiscarded = "discarded"

// BulkAction is what a bulk action does to every dead letter of its
// filter.
type BulkAction string

// The bulk actions.
const (
	// BulkReplay replays each through ReplayTx.
	BulkReplay BulkAction = "replay"
	// BulkDiscard moves each from dead to StateDiscarded.
	BulkDiscard BulkAction = "discard"
)

// Valid reports an unknown action.
func (a BulkAction) Valid() error {
	if a != BulkReplay && a != BulkDiscard {
		return fmt.Errorf("dlq: bulk action %q: want replay or discard", string(a))
	}
	return nil
}

// BulkCommand is the command of a bulk action's one audit row: "bulk
// replay dead letters", "bulk discard dead letters".
func BulkCommand(a BulkAction) string { return "bulk " + string(a) + " dead letters" }

// BulkPlan is a bulk action's dry run: how many dead letters its filter
// selects now, the largest id among them (the action never goes past
// it: dead letters recorded after the dry run are not part of it), and
// the first few.
type BulkPlan struct {
	Count  int
	MaxID  int64
	Sample []DeadLetter
}

// PlanBulk is the dry run of a bulk action over f (its dead rows only:
// f.Pending is set; f.IDs and f.Limit must be unset), with up to sample
// rows, in db or the caller's transaction. It changes nothing.
func PlanBulk(ctx context.Context, db postgres.Handle, f Filter, sample int) (BulkPlan, error) {
	if len(f.IDs) > 0 || f.Limit != 0 {
		return BulkPlan{}, errors.New("dlq: PlanBulk: a bulk action's filter selects by topic, error and time, not by ids or a limit")
	}
	q, err := storage.FromHandle(db)
	if err != nil {
		return BulkPlan{}, fmt.Errorf("dlq: PlanBulk: %w", err)
	}
	f.Pending = true
	var p BulkPlan
	if p.Count, p.MaxID, err = storage.CountDeadLettersUpTo(ctx, q, f.selection()); err != nil {
		return p, fmt.Errorf("dlq: counting the dead letters of a bulk action%s: %w", storage.Hint(err), err)
	}
	if sample > 0 && p.Count > 0 {
		f.Limit = sample
		if p.Sample, err = list(ctx, q, f); err != nil {
			return p, err
		}
	}
	return p, nil
}

// BulkJob is one bulk action: its filter and how far it got.
type BulkJob struct {
	ID     int64
	Action BulkAction
	Filter Filter
	// MaxID is the dry run's bound; Planned its count, which the
	// operator confirmed under Cap.
	MaxID        int64
	Cap, Planned int
	// Cursor is the last id handled: the run continues after it.
	Cursor int64
	// Done counts the dead letters replayed (discarded); Skipped those
	// no longer dead when their turn came (replayed or resolved
	// meanwhile by someone else).
	Done, Skipped int
	// State is "running", "done" or "failed" (Error says why; resume it
	// after the fix).
	State, Error         string
	By                   string
	CreatedAt, UpdatedAt time.Time
}

// Finished reports whether the job has nothing left to do.
func (j BulkJob) Finished() bool { return j.State == "done" }

// ErrOverCap is returned (wrapped) by StartBulkTx when the filter selects
// more dead letters than the cap the operator confirmed.
var ErrOverCap = errors.New("dlq: the bulk action selects more dead letters than its cap")

// ErrBulkNotFound is returned (wrapped) for an unknown bulk job id.
var ErrBulkNotFound = errors.New("dlq: no such bulk action")

// bulkFilter is a Filter as a bulk job stores it.
type bulkFilter struct {
	Topic         string    `json:"topic,omitempty"`
	ErrorType     string    `json:"error_type,omitempty"`
	ErrorContains string    `json:"error_contains,omitempty"`
	Since         time.Time `json:"since,omitzero"`
	Until         time.Time `json:"until,omitzero"`
}

// BulkArgs are the audit arguments naming f.
func BulkArgs(f Filter) []string {
	var args []string
	if f.Topic != "" {
		args = append(args, "--topic="+f.Topic)
	}
	if f.ErrorType != "" {
		args = append(args, "--error-type="+f.ErrorType)
	}
	if f.ErrorContains != "" {
		args = append(args, "--error-contains="+f.ErrorContains)
	}
	if !f.Since.IsZero() {
		args = append(args, "--since="+f.Since.UTC().Format(time.RFC3339Nano))
	}
	if !f.Until.IsZero() {
		args = append(args, "--until="+f.Until.UTC().Format(time.RFC3339Nano))
	}
	return args
}

// StartBulkTx records a bulk action over f as its dry run planned it (a
// BulkPlan), in tx, and returns its id; RunBulk then runs it. It plans
// again in tx and refuses (ErrOverCap, nothing recorded) when the filter
// now selects more than limit dead letters (the cap the operator
// confirmed, >= 1); rows recorded since the dry run are left out (its
// MaxID bounds the action).
func StartBulkTx(ctx context.Context, tx postgres.Tx, action BulkAction, f Filter, plan BulkPlan, limit int, by audit.Operator) (int64, error) {
	if err := action.Valid(); err != nil {
		return 0, err
	}
	if err := by.Valid(); err != nil {
		return 0, fmt.Errorf("dlq: StartBulkTx: %w", err)
	}
	if plan.Count == 0 || plan.MaxID == 0 {
		return 0, fmt.Errorf("dlq: bulk %s: the dry run selected no dead letter: nothing to do", action)
	}
	if limit < 1 {
		return 0, fmt.Errorf("dlq: bulk %s: the cap is %d: confirm a cap of at least the dry run's count (%d)", action, limit, plan.Count)
	}
	q, err := storage.FromTx(tx)
	if err != nil {
		return 0, fmt.Errorf("dlq: StartBulkTx: %w", err)
	}
	if err := audit.Ready(ctx, tx); err != nil {
		return 0, fmt.Errorf("dlq: bulk %s: %w", action, err)
	}
	bf := f
	bf.Pending = true
	now, _, err := storage.CountDeadLettersUpTo(ctx, q, withMaxID(bf, plan.MaxID).selection())
	if err != nil {
		return 0, fmt.Errorf("dlq: bulk %s: counting%s: %w", action, storage.Hint(err), err)
	}
	if now > limit {
		return 0, fmt.Errorf("%w: bulk %s selects %d dead letters, over the cap of %d you confirmed: run the dry run again and confirm a larger cap, or narrow the filter", ErrOverCap, action, now, limit)
	}
	js, err := json.Marshal(bulkFilter{Topic: f.Topic, ErrorType: f.ErrorType, ErrorContains: f.ErrorContains, Since: f.Since, Until: f.Until})
	if err != nil {
		return 0, fmt.Errorf("dlq: bulk %s: encoding its filter: %w", action, err)
	}
	id, err := storage.InsertBulk(ctx, q, storage.BulkRow{Action: string(action), Filter: js, MaxID: plan.MaxID, Cap: limit, Planned: now, CreatedBy: by.User})
	if err != nil {
		return 0, fmt.Errorf("dlq: recording bulk %s (did `millwright migrate` run? dlq migration 007): %w", action, err)
	}
	return id, nil
}

// withMaxID bounds f to ids <= maxID: the rows the dry run saw.
func withMaxID(f Filter, maxID int64) Filter {
	f.maxID = maxID
	return f
}

// BulkRunOptions says how RunBulk and BulkBatchTx run a job.
type BulkRunOptions struct {
	// By is the operator (the dead letters record them; the job's audit
	// row names them). Required.
	By audit.Operator
	// Batch is how many dead letters each transaction handles. Default
	// 100; 1..10000.
	Batch int
	// Progress, if set, is called by RunBulk after each committed batch
	// with the job as it stands.
	Progress func(BulkJob)
}

// RunBulk runs bulk job id to its end, batch by batch, each batch a
// BulkBatchTx in its own transaction of db: an interrupted run (ctx
// ended, the process died) loses at most its uncommitted batch, which
// rolled back whole, and RunBulk again continues after the cursor: no
// dead letter is ever handled twice. A failed batch marks the job failed
// with its error (MarkBulkFailedTx, in a transaction of its own) and
// returns the error; an interrupted one leaves it running. It returns the
// job as its last committed batch left it.
func RunBulk(ctx context.Context, db postgres.DB, id int64, opts BulkRunOptions) (BulkJob, error) {
	pool, err := storage.FromDB(db)
	if err != nil {
		return BulkJob{}, fmt.Errorf("dlq: RunBulk: %w", err)
	}
	inTx := func(f func(tx postgres.Tx) error) error {
		tx, err := pool.Begin(ctx, storage.TxOptions{})
		if err != nil {
			return fmt.Errorf("dlq: bulk action %d: %w", id, err)
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			_ = tx.Rollback(rctx) // a no-op after Commit
		}()
		if err := f(storage.TxOf(tx)); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("dlq: committing a batch of bulk action %d (it rolled back whole unless it landed: run it again, it continues after its cursor): %w", id, err)
		}
		return nil
	}
	var last BulkJob // as the last committed batch left it
	for {
		var (
			job  BulkJob
			more bool
		)
		err := inTx(func(tx postgres.Tx) error {
			var err error
			job, more, err = BulkBatchTx(ctx, tx, id, opts)
			return err
		})
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, ErrBulkNotFound) {
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
				defer cancel()
				cause := err
				ferr := func() error {
					tx, err := pool.Begin(rctx, storage.TxOptions{})
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback(rctx) }()
					if err := MarkBulkFailedTx(rctx, storage.TxOf(tx), id, cause); err != nil {
						return err
					}
					return tx.Commit(rctx)
				}()
				err = errors.Join(err, ferr)
			}
			return last, err
		}
		last = job
		if opts.Progress != nil {
			opts.Progress(job)
		}
		if !more {
			return job, nil
		}
	}
}

// BulkBatchTx runs the next batch of bulk job id in tx, the caller's
// transaction (the console's, in its schema): it locks the job's row (two
// runners of one job take turns), handles the next dead letters after its
// cursor, by id up to its MaxID, with ReplayTx (or the discard), and
// advances the cursor and the counts. more is false once the job is done:
// the batch that finishes it writes the job's one audit row (BulkCommand:
// the filter, the job, and the count done); the dead letters themselves
// record the operator (no audit row each). Commit tx to keep the batch;
// after an error, roll it back (then MarkBulkFailedTx, in another
// transaction, records the error on the job).
func BulkBatchTx(ctx context.Context, tx postgres.Tx, id int64, opts BulkRunOptions) (BulkJob, bool, error) {
	if err := opts.By.Valid(); err != nil {
		return BulkJob{}, false, fmt.Errorf("dlq: BulkBatchTx: %w", err)
	}
	if opts.Batch == 0 {
		opts.Batch = 100
	}
	if opts.Batch < 1 || opts.Batch > 10000 {
		return BulkJob{}, false, fmt.Errorf("dlq: BulkRunOptions.Batch %d: want 1..10000", opts.Batch)
	}
	q, err := storage.FromTx(tx)
	if err != nil {
		return BulkJob{}, false, fmt.Errorf("dlq: BulkBatchTx: %w", err)
	}
	row, err := storage.LockBulk(ctx, q, id)
	if storage.IsNoRows(err) {
		return BulkJob{}, false, fmt.Errorf("%w: %d (see the console's bulk actions page)", ErrBulkNotFound, id)
	}
	if err != nil {
		return BulkJob{}, false, fmt.Errorf("dlq: reading bulk action %d (did `millwright migrate` run? dlq migration 007): %w", id, err)
	}
	job, err := bulkJob(row)
	if err != nil || job.State == "done" {
		return job, false, err
	}
	f := withMaxID(job.Filter, job.MaxID)
	f.Pending, f.afterID, f.Limit = true, job.Cursor, opts.Batch
	ids, err := listRefs(ctx, q, f)
	if err != nil {
		return job, false, err
	}
	for _, dl := range ids {
		ok, err := bulkOne(ctx, tx, q, job, dl, opts.By)
		if err != nil {
			return job, false, fmt.Errorf("dlq: bulk action %d stopped at dead letter %d (the batch rolled back; fix it and resume): %w", id, dl, err)
		}
		if ok {
			job.Done++
		} else {
			job.Skipped++
		}
		job.Cursor = dl
	}
	more := len(ids) == opts.Batch
	job.State, job.Error = "running", ""
	if !more {
		job.State = "done"
		args := append(BulkArgs(job.Filter), "--job="+strconv.FormatInt(job.ID, 10), fmt.Sprintf("--planned=%d", job.Planned),
			fmt.Sprintf("--cap=%d", job.Cap), fmt.Sprintf("--skipped=%d", job.Skipped))
		if _, err := audit.RecordTx(ctx, tx, opts.By.Entry(BulkCommand(job.Action), args, int64(job.Done))); err != nil {
			return job, false, fmt.Errorf("dlq: auditing bulk action %d: %w", id, err)
		}
	}
	if err := storage.AdvanceBulk(ctx, q, bulkRow(job)); err != nil {
		return job, false, fmt.Errorf("dlq: advancing bulk action %d: %w", id, err)
	}
	return job, more, nil
}

// bulkOne handles dead letter id of job in tx: false when it was no
// longer dead.
func bulkOne(ctx context.Context, tx postgres.Tx, q storage.Querier, job BulkJob, id int64, by audit.Operator) (bool, error) {
	switch job.Action {
	case BulkDiscard:
		ok, err := storage.DiscardDeadLetter(ctx, q, id, by.User)
		if err != nil {
			return false, fmt.Errorf("dlq: discarding dead letter %d: %w", id, err)
		}
		return ok, nil
	default:
		_, err := ReplayTx(ctx, tx, id, ReplayOneOptions{By: by, bulk: job.ID})
		if errors.Is(err, ErrNotDead) {
			return false, nil
		}
		return err == nil, err
	}
}

// MarkBulkFailedTx records cause on bulk job id, in tx: the job shows
// failed with its error until resumed.
func MarkBulkFailedTx(ctx context.Context, tx postgres.Tx, id int64, cause error) error {
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("dlq: MarkBulkFailedTx: %w", err)
	}
	row, err := storage.LockBulk(ctx, q, id)
	if err != nil {
		return fmt.Errorf("dlq: recording the failure of bulk action %d: %w", id, err)
	}
	row.State, row.Error = "failed", cause.Error()
	return storage.AdvanceBulk(ctx, q, row)
}

func bulkRow(j BulkJob) storage.BulkRow {
	return storage.BulkRow{ID: j.ID, Cursor: j.Cursor, Done: j.Done, Skipped: j.Skipped, State: j.State, Error: j.Error}
}

func bulkJob(r storage.BulkRow) (BulkJob, error) {
	var bf bulkFilter
	if err := json.Unmarshal(r.Filter, &bf); err != nil {
		return BulkJob{}, fmt.Errorf("dlq: bulk action %d: decoding its filter: %w", r.ID, err)
	}
	return BulkJob{ID: r.ID, Action: BulkAction(r.Action), Filter: Filter{Topic: bf.Topic, ErrorType: bf.ErrorType, ErrorContains: bf.ErrorContains,
		Since: bf.Since, Until: bf.Until}, MaxID: r.MaxID, Cap: r.Cap, Planned: r.Planned, Cursor: r.Cursor, Done: r.Done, Skipped: r.Skipped,
		State: r.State, Error: r.Error, By: r.CreatedBy, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}, nil
}

// BulkJobs returns the newest limit bulk actions, newest first, in db or
// the caller's transaction.
func BulkJobs(ctx context.Context, db postgres.Handle, limit int) ([]BulkJob, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("dlq: BulkJobs: %w", err)
	}
	rows, err := storage.ListBulk(ctx, q, limit)
	if err != nil {
		return nil, fmt.Errorf("dlq: listing bulk actions (did `millwright migrate` run? dlq migration 007): %w", err)
	}
	out := make([]BulkJob, 0, len(rows))
	for _, r := range rows {
		j, err := bulkJob(r)
		if err != nil {
			return nil, err
		}
		out = append(out, j)
	}
	return out, nil
}

// GetBulkJob returns bulk action id, in db or the caller's transaction.
func GetBulkJob(ctx context.Context, db postgres.Handle, id int64) (BulkJob, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return BulkJob{}, fmt.Errorf("dlq: GetBulkJob: %w", err)
	}
	r, err := storage.GetBulk(ctx, q, id)
	if storage.IsNoRows(err) {
		return BulkJob{}, fmt.Errorf("%w: %d", ErrBulkNotFound, id)
	}
	if err != nil {
		return BulkJob{}, fmt.Errorf("dlq: reading bulk action %d: %w", id, err)
	}
	return bulkJob(r)
}
