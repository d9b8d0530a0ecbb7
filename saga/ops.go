package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
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
	// starts, and again after a late success or an operator's retry).
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

// Querier reads and writes saga tables: *sql.DB, *sql.Tx and *sql.Conn
// satisfy it.
type Querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Filter selects instances for List. Zero fields match everything.
type Filter struct {
	Type  string
	State State
	// Limit caps the rows returned, newest first. Default 100; -1 no limit.
	Limit int
}

// stepName resolves the current step's name from the history: the most
// recent entry of the current step index is not recorded, so it is the
// step of the newest command or compensation entry.
const infoSelect = `SELECT i.id, i.type, i.state, i.current_step, i.data, i.version, i.deadline_at,
	i.awaiting_reply, i.compensation_attempts, COALESCE(i.cause, ''), COALESCE(i.last_error, ''), i.created_at, i.updated_at,
	COALESCE((SELECT s.step FROM millwright_saga_steps s WHERE s.saga_id = i.id
		AND s.kind IN ('command', 'compensation', 'resolved') ORDER BY s.id DESC LIMIT 1), '')
	FROM millwright_saga_instances i`

func scanInfo(sc interface{ Scan(...any) error }) (Info, error) {
	var in Info
	var deadline sql.NullTime
	var data []byte
	err := sc.Scan(&in.ID, &in.Type, &in.State, &in.StepIndex, &data, &in.Version, &deadline,
		&in.AwaitingReply, &in.CompensationAttempts, &in.Cause, &in.LastError, &in.CreatedAt, &in.UpdatedAt, &in.Step)
	in.Data = data
	in.Deadline = deadline.Time
	if in.State == StateCompleted || in.StepIndex < 0 {
		in.Step = ""
	}
	return in, err
}

// List returns instances matching f, newest first.
func List(ctx context.Context, db Querier, f Filter) ([]Info, error) {
	q := infoSelect + ` WHERE ($1 = '' OR i.type = $1) AND ($2 = '' OR i.state = $2) ORDER BY i.created_at DESC, i.id`
	limit := f.Limit
	if limit == 0 {
		limit = 100
	}
	args := []any{f.Type, string(f.State)}
	if limit > 0 {
		q += ` LIMIT $3`
		args = append(args, limit)
	}
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("saga: listing instances (did `millwright migrate` run?): %w", err)
	}
	defer rows.Close()
	var out []Info
	for rows.Next() {
		in, err := scanInfo(rows)
		if err != nil {
			return nil, fmt.Errorf("saga: listing instances: %w", err)
		}
		out = append(out, in)
	}
	return out, rows.Err()
}

// Get returns instance id and its step history, oldest entry first. The
// error wraps ErrNotFound when there is no such instance.
func Get(ctx context.Context, db Querier, id string) (Info, []HistoryEntry, error) {
	in, err := scanInfo(db.QueryRowContext(ctx, infoSelect+` WHERE i.id = $1`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return in, nil, fmt.Errorf("saga %q: %w", id, ErrNotFound)
	}
	if err != nil {
		return in, nil, fmt.Errorf("saga %q: loading (did `millwright migrate` run?): %w", id, err)
	}
	h, err := History(ctx, db, id)
	return in, h, err
}

// History returns the step history of saga id, oldest entry first.
func History(ctx context.Context, db Querier, id string) ([]HistoryEntry, error) {
	rows, err := db.QueryContext(ctx, `SELECT step, kind, detail, attempt, COALESCE(error, ''), at
		FROM millwright_saga_steps WHERE saga_id = $1 ORDER BY id`, id)
	if err != nil {
		return nil, fmt.Errorf("saga %q: reading history: %w", id, err)
	}
	defer rows.Close()
	var out []HistoryEntry
	for rows.Next() {
		var h HistoryEntry
		if err := rows.Scan(&h.Step, &h.Kind, &h.Detail, &h.Attempt, &h.Error, &h.At); err != nil {
			return nil, fmt.Errorf("saga %q: reading history: %w", id, err)
		}
		out = append(out, h)
	}
	return out, rows.Err()
}

// ResolveAction is what an operator does with a stuck saga.
type ResolveAction string

const (
	// ResolveRetry sends the stuck compensation again with a fresh retry
	// budget: for a participant that was broken and is fixed.
	ResolveRetry ResolveAction = "retry"
	// ResolveSkip records the stuck compensation as done by hand and goes
	// on with the compensations of the earlier steps.
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
// ones it interrupted). The change is a row update (the next Run
// round of any orchestrator of the type sends the command), recorded in the
// history; no Definition is needed, so the CLI can call it. With dryRun
// nothing is written. The error wraps ErrNotFound or ErrNotStuck when the
// saga cannot be resolved.
func Resolve(ctx context.Context, db *sql.DB, id string, action ResolveAction, note string, dryRun bool) (Resolution, error) {
	if action != ResolveRetry && action != ResolveSkip {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: unknown action %q: want %q or %q", id, action, ResolveRetry, ResolveSkip)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: begin: %w", id, err)
	}
	defer func() { _ = tx.Rollback() }()
	// resume is set while the compensation of a late success runs: the
	// step whose compensation follows it.
	var resume sql.NullInt64
	if err := tx.QueryRowContext(ctx, `SELECT resume_step FROM millwright_saga_instances WHERE id = $1 FOR UPDATE`, id).Scan(&resume); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return Resolution{}, fmt.Errorf("saga %q: %w", id, ErrNotFound)
		}
		return Resolution{}, fmt.Errorf("saga %q: locking instance: %w", id, err)
	}
	in, _, err := Get(ctx, tx, id)
	if err != nil {
		return Resolution{}, err
	}
	r := Resolution{Info: in, Action: action, DryRun: dryRun}
	if in.State != StateStuck {
		return r, fmt.Errorf("saga %q is %s, not stuck: only stuck sagas are resolved: %w", id, in.State, ErrNotStuck)
	}
	next := in.StepIndex
	switch action {
	case ResolveRetry:
		r.Description = fmt.Sprintf("resend the compensation of step %q (index %d) with a fresh retry budget; it failed %d time(s), last: %s",
			in.Step, in.StepIndex, in.CompensationAttempts, in.LastError)
	case ResolveSkip:
		next = in.StepIndex - 1
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
		resume = sql.NullInt64{}
	}
	if dryRun {
		return r, nil
	}
	// The next Run round starts a new round of the step's compensation,
	// numbered after its earlier attempts.
	if _, err := tx.ExecContext(ctx, `UPDATE millwright_saga_instances SET state = 'compensating',
		current_step = $2, version = version + 1, deadline_at = now(), awaiting_reply = false,
		compensation_attempts = 0, compensation_started_at = NULL, resume_step = $3, updated_at = now()
		WHERE id = $1`, id, next, resume); err != nil {
		return r, fmt.Errorf("saga %q: resolving: %w", id, err)
	}
	detail := string(action)
	if note = strings.TrimSpace(note); note != "" {
		detail += ": " + note
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO millwright_saga_steps (saga_id, step, kind, detail, attempt)
		VALUES ($1, $2, $3, $4, $5)`, id, in.Step, KindResolved, detail, in.CompensationAttempts); err != nil {
		return r, fmt.Errorf("saga %q: recording resolution: %w", id, err)
	}
	if err := tx.Commit(); err != nil {
		return r, fmt.Errorf("saga %q: commit: %w", id, err)
	}
	return r, nil
}
