package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Info is a saga instance as stored, for operators: it needs no Definition.
type Info struct {
	ID    string
	Type  string
	State State
	// Step is the current step's name ("" when the saga has no current
	// step: completed, or compensated with nothing left).
	Step string
	// StepIndex is the current step's index (-1 when none is left).
	StepIndex int
	Data      json.RawMessage
	Version   int64
	// Deadline is when the timeout loop acts next (zero: nothing scheduled).
	Deadline      time.Time
	AwaitingReply bool
	// CompensationAttempts counts the attempts of the current
	// compensation round (a round starts when the compensation of a step
	// starts, and again after a late success or an operator's retry). At
	// a Retriable step (running, or stuck on its command) it counts the
	// attempts of the step's command instead.
	CompensationAttempts int
	// Cause is why the saga is compensating ("" if it never failed): the
	// failure reply, timeout or command error that started the
	// compensation.
	Cause string
	// LastError is the cause, then (while compensations fail, or a late
	// success is undone) what happened since; back to the cause once the
	// saga is compensated.
	LastError string
	CreatedAt time.Time
	UpdatedAt time.Time
	// Branches is the state of each branch of the parallel groups the
	// saga entered, by branch name (nil: none entered).
	Branches map[string]BranchInfo
}

// HistoryEntry is one row of a saga's step history.
type HistoryEntry struct {
	Step    string
	Kind    string
	Detail  string
	Attempt int
	Error   string
	At      time.Time
}

// Filter selects instances for List. Zero fields match everything.
type Filter struct {
	Type  string
	State State
	// Limit caps the rows returned, newest first. Default 100; -1 no limit.
	Limit int
}

func infoOf(r storage.SagaInfoRow) Info {
	in := Info{ID: r.ID, Type: r.Type, State: State(r.State), Step: r.Step, StepIndex: r.StepIndex, Data: r.Data,
		Version: r.Version, Deadline: r.Deadline.Time, AwaitingReply: r.AwaitingReply,
		CompensationAttempts: r.CompensationAttempts, Cause: r.Cause, LastError: r.LastError,
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt, Branches: branchesOf(r.Branches)}
	if in.State == StateCompleted || in.StepIndex < 0 {
		in.Step = ""
	}
	return in
}

// List returns instances matching f, newest first.
func List(ctx context.Context, db postgres.Handle, f Filter) ([]Info, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("saga: listing instances: %w", err)
	}
	limit := f.Limit
	if limit == 0 {
		limit = 100
	}
	rows, err := storage.ListSagas(ctx, q, f.Type, string(f.State), limit)
	if err != nil {
		return nil, fmt.Errorf("saga: listing instances%s: %w", storage.Hint(err), err)
	}
	out := make([]Info, 0, len(rows))
	for _, r := range rows {
		out = append(out, infoOf(r))
	}
	return out, nil
}

// Summary counts the instances of one type in one state.
type Summary struct {
	Type  string
	State State
	Count int64
	// Oldest is when the oldest of them started.
	Oldest time.Time
}

// Summarize counts the instances by type and state (by type, then
// state): the operator console's overview, in its transaction.
func Summarize(ctx context.Context, db postgres.Handle) ([]Summary, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("saga: Summarize: %w", err)
	}
	rows, err := storage.SummarizeSagas(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("saga: counting instances%s: %w", storage.Hint(err), err)
	}
	out := make([]Summary, len(rows))
	for i, r := range rows {
		out[i] = Summary{Type: r.Type, State: State(r.State), Count: r.Count, Oldest: r.Oldest}
	}
	return out, nil
}

// Get returns instance id and its step history, oldest entry first. The
// error wraps ErrNotFound when there is no such instance.
func Get(ctx context.Context, db postgres.Handle, id string) (Info, []HistoryEntry, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return Info{}, nil, fmt.Errorf("saga %q: %w", id, err)
	}
	in, err := get(ctx, q, id)
	if err != nil {
		return in, nil, err
	}
	h, err := History(ctx, db, id)
	return in, h, err
}

func get(ctx context.Context, q storage.Querier, id string) (Info, error) {
	r, err := storage.GetSaga(ctx, q, id)
	if storage.IsNoRows(err) {
		return Info{}, fmt.Errorf("saga %q: %w", id, ErrNotFound)
	}
	if err != nil {
		return Info{}, fmt.Errorf("saga %q: loading%s: %w", id, storage.Hint(err), err)
	}
	return infoOf(r), nil
}

// History returns the step history of saga id, oldest entry first.
func History(ctx context.Context, db postgres.Handle, id string) ([]HistoryEntry, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("saga %q: reading history: %w", id, err)
	}
	rows, err := storage.SagaHistory(ctx, q, id)
	if err != nil {
		return nil, fmt.Errorf("saga %q: reading history: %w", id, err)
	}
	out := make([]HistoryEntry, len(rows))
	for i, r := range rows {
		out[i] = HistoryEntry{Step: r.Step, Kind: r.Kind, Detail: r.Detail, Attempt: r.Attempt, Error: r.Error, At: r.At}
	}
	return out, nil
}

// ResolveAction is what an operator does with a stuck saga.
type ResolveAction string

const (
	// ResolveRetry sends the stuck compensation again with a fresh retry
	// budget: for a participant that was broken and is fixed. A saga stuck
	// on a Retriable step's command has that command sent again instead.
	ResolveRetry ResolveAction = "retry"
	// ResolveSkip records the stuck compensation as done by hand and goes
	// on with the compensations of the earlier steps. A saga stuck on a
	// Retriable step's command takes the step as done by hand and goes on
	// with the next step (or completes).
	ResolveSkip ResolveAction = "skip"
)

// ErrNotStuck is returned (wrapped) by Resolve for a saga that is not in
// the stuck state.
var ErrNotStuck = errors.New("saga: instance is not stuck")

// Resolution says what Resolve did, or would do with DryRun.
type Resolution struct {
	Info   Info
	Action ResolveAction
	// Description is a sentence for the operator.
	Description string
	DryRun      bool
}

// Resolve hands a stuck saga back to the orchestrators: with ResolveRetry
// the stuck compensation is sent again with a fresh budget; with
// ResolveSkip the compensation is taken as done by hand and the earlier
// steps' compensations follow (for the compensation of a late success, the
// ones it interrupted). A saga stuck on a Retriable step's command has
// the command sent again in a fresh round (retry), or the step taken as
// done by hand and the next step sent (skip). The change is a row update (the next Run
// round of any orchestrator of the type sends the command), recorded in the
// history; no Definition is needed, so the CLI can call it. With dryRun
// nothing is written. The error wraps ErrNotFound or ErrNotStuck when the
// saga cannot be resolved.
func Resolve(ctx context.Context, db postgres.DB, id string, action ResolveAction, note string, dryRun bool) (Resolution, error) {
	if action != ResolveRetry && action != ResolveSkip {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: unknown action %q: want %q or %q", id, action, ResolveRetry, ResolveSkip)
	}
	var r Resolution
	errDry := errors.New("dry run: roll back")
	err := db.InTx(ctx, func(tx postgres.Tx) error {
		var err error
		if r, err = ResolveTx(ctx, tx, id, action, note, dryRun); err != nil {
			return err
		}
		if dryRun {
			return errDry // nothing was written; roll back all the same
		}
		return nil
	})
	if errors.Is(err, errDry) {
		err = nil
	}
	return r, err
}

// ResolveTx is Resolve in the caller's transaction tx: the caller commits,
// and the change is made if and only if it does. Resolve and the CLI's
// `millwright saga resolve` call it; the operator console too, adding its
// audit row (audit.RecordTx) in the same transaction, in the schema it
// selected.
func ResolveTx(ctx context.Context, tx postgres.Tx, id string, action ResolveAction, note string, dryRun bool) (Resolution, error) {
	if action != ResolveRetry && action != ResolveSkip {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: unknown action %q: want %q or %q", id, action, ResolveRetry, ResolveSkip)
	}
	q, err := storage.FromTx(tx)
	if err != nil {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: %w", id, err)
	}
	return resolveIn(ctx, q, id, action, note, dryRun)
}

// resolveIn is Resolve's work in tx, without the commit.
func resolveIn(ctx context.Context, tx storage.Querier, id string, action ResolveAction, note string, dryRun bool) (Resolution, error) {
	// resume is set while the compensation of a late success runs: the
	// step whose compensation follows it.
	resume, err := storage.LockSagaResume(ctx, tx, id)
	if storage.IsNoRows(err) {
		return Resolution{}, fmt.Errorf("saga %q: %w", id, ErrNotFound)
	}
	if err != nil {
		return Resolution{}, fmt.Errorf("saga %q: locking instance: %w", id, err)
	}
	in, err := get(ctx, tx, id)
	if err != nil {
		return Resolution{}, err
	}
	r := Resolution{Info: in, Action: action, DryRun: dryRun}
	if in.State != StateStuck {
		return r, fmt.Errorf("saga %q is %s, not stuck: only stuck sagas are resolved: %w", id, in.State, ErrNotStuck)
	}
	if fwd, err := storage.SagaForwardRetry(ctx, tx, id); err != nil {
		return r, fmt.Errorf("saga %q: reading forward_retry%s: %w", id, storage.Hint(err), err)
	} else if fwd { // stuck on a Retriable step's command (wait.go)
		return resolveForward(ctx, tx, r, note)
	}
	next, resume := resolution(&r, resume)
	if dryRun {
		return r, nil
	}
	detail := string(action)
	if note = strings.TrimSpace(note); note != "" {
		detail += ": " + note
	}
	// The next Run round starts a new round of the step's compensation,
	// numbered after its earlier attempts.
	if err := storage.ResolveSaga(ctx, tx, id, next, resume,
		storage.SagaStep{Step: in.Step, Kind: KindResolved, Detail: detail, Attempt: in.CompensationAttempts}); err != nil {
		return r, fmt.Errorf("saga %q: resolving: %w", id, err)
	}
	return r, nil
}

// resolution describes r (a stuck saga's resolution) for the operator and
// returns the step whose compensation goes next and the resume step after
// it.
func resolution(r *Resolution, resume sql.NullInt64) (int, sql.NullInt64) {
	in := r.Info
	if r.Action == ResolveRetry {
		r.Description = fmt.Sprintf("resend the compensation of step %q (index %d) with a fresh retry budget; it failed %d time(s), last: %s",
			in.Step, in.StepIndex, in.CompensationAttempts, in.LastError)
		return in.StepIndex, resume
	}
	next := in.StepIndex - 1
	r.Description = fmt.Sprintf("mark the compensation of step %q (index %d) as done by hand and continue with the compensations of the steps before it",
		in.Step, in.StepIndex)
	if resume.Valid {
		// The stuck compensation undoes a late success; the chain it
		// interrupted goes on where it was.
		next = int(resume.Int64)
		r.Description = fmt.Sprintf("mark the compensation of step %q (index %d, undoing its success after its timeout) as done by hand and go back to the compensations it interrupted",
			in.Step, in.StepIndex)
	}
	if next < 0 {
		r.Description = fmt.Sprintf("mark the compensation of step %q (index %d) as done by hand; no earlier step is left, so the saga becomes compensated",
			in.Step, in.StepIndex)
	}
	return next, sql.NullInt64{}
}
