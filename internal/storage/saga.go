package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// SagaInstance is a row of millwright_saga_instances.
type SagaInstance struct {
	ID    string
	Type  string
	State string
	// Step is current_step: the index of the current step (-1 once no
	// compensation is left).
	Step int
	// Data is the saga data, JSON.
	Data    []byte
	Version int64
	// Deadline is when the timeout loop acts next.
	Deadline     sql.NullTime
	Awaiting     bool
	CompAttempts int
	CompStarted  sql.NullTime
	LastError    sql.NullString
	CreatedAt    time.Time
	AttemptBase  int
	ResumeStep   sql.NullInt64
	Cause        sql.NullString
	// Branches is the state of the branches of the saga's parallel
	// groups, a JSON object (nil: NULL, no group entered).
	Branches []byte
	// ForwardRetry: the round columns (CompAttempts, CompStarted,
	// AttemptBase) count a Retriable step's command attempts.
	ForwardRetry bool
}

// SagaStep is one row of a saga's step history (millwright_saga_steps) as a
// transition writes it. An empty Error is stored as NULL.
type SagaStep struct {
	Step, Kind, Detail string
	Attempt            int
	Error              string
}

const sagaInstanceColumns = `id, type, state, current_step, data::text, version, deadline_at, awaiting_reply,
	compensation_attempts, compensation_started_at, last_error, created_at,
	compensation_attempt_base, resume_step, cause, branches::text, forward_retry`

func (in *SagaInstance) dest() []any {
	return []any{&in.ID, &in.Type, &in.State, &in.Step, &in.Data, &in.Version, &in.Deadline, &in.Awaiting,
		&in.CompAttempts, &in.CompStarted, &in.LastError, &in.CreatedAt,
		&in.AttemptBase, &in.ResumeStep, &in.Cause, &in.Branches, &in.ForwardRetry}
}

// The history rows go as five arrays, unnested in order: one statement
// whatever their number, and the ids (BIGSERIAL) follow that order.
const sagaStepsFrom = `unnest($2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[]) WITH ORDINALITY AS u(s, k, d, a, e, o)`

func sagaStepArgs(first any, steps []SagaStep) []any {
	n := len(steps)
	names, kinds, details, errs := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	attempts := make([]int64, n)
	for i, s := range steps {
		names[i], kinds[i], details[i], attempts[i], errs[i] = s.Step, s.Kind, s.Detail, int64(s.Attempt), s.Error
	}
	return []any{first, names, kinds, details, attempts, errs}
}

const insertSagaSQL = `WITH x AS (INSERT INTO millwright_saga_instances
	(id, type, state, current_step, data, deadline_at, awaiting_reply, created_at, updated_at, branches)
	VALUES ($1, $7, $8, $9, $10::jsonb, $11, $12, $13, $13, $14::jsonb) ON CONFLICT (id) DO NOTHING RETURNING id)
	INSERT INTO millwright_saga_steps (saga_id, step, kind, detail, attempt, error)
	SELECT x.id, u.s, u.k, u.d, u.a, NULLIF(u.e, '') FROM x, ` + sagaStepsFrom + ` ORDER BY u.o`

// InsertSaga writes a new instance (ID, Type, State, Step, Data, Deadline,
// Awaiting; created and updated at CreatedAt) with its first history rows
// (at least one), in one statement. It returns false, writing nothing and
// leaving the transaction usable, when an instance with the id exists.
// Data jsonb would refuse is refused first, with an error wrapping
// ErrJSONBRefuses that names the field (CheckJSONB), and so is
// an id Postgres text cannot hold.
func InsertSaga(ctx context.Context, q Querier, in SagaInstance, steps []SagaStep) (inserted bool, err error) {
	if len(steps) == 0 {
		return false, fmt.Errorf("storage: inserting saga %q: no history row (a new saga records its first command)", in.ID)
	}
	if !utf8.ValidString(in.ID) || strings.ContainsRune(in.ID, 0) {
		return false, fmt.Errorf("storage: inserting saga %q: the id is not valid UTF-8 or holds a NUL byte, which Postgres text cannot store: use a text id (e.g. the order id or a UUID)", in.ID)
	}
	if err := CheckJSONB(in.Data); err != nil {
		return false, fmt.Errorf("storage: inserting saga %q: its data: %w", in.ID, err)
	}
	args := append(sagaStepArgs(in.ID, steps), in.Type, in.State, in.Step, string(in.Data),
		sagaNullTime(in.Deadline), in.Awaiting, in.CreatedAt, sagaNullJSON(in.Branches))
	n, err := q.Exec(ctx, Statement{SQL: insertSagaSQL, Args: args, Expect: NoExpect, What: "inserting saga instance " + in.ID})
	if err != nil {
		return false, err
	}
	return n > 0, nil
}

// LockSaga reads instance id and locks it (FOR UPDATE) until the end of
// q's transaction. No such instance is an error for which IsNoRows holds.
func LockSaga(ctx context.Context, q Querier, id string) (SagaInstance, error) {
	var in SagaInstance
	err := q.QueryRow(ctx, S(`SELECT `+sagaInstanceColumns+` FROM millwright_saga_instances WHERE id = $1 FOR UPDATE`, id), in.dest()...)
	return in, err
}

// ClaimDueSagas returns up to limit instances of type typ whose deadline
// has passed, earliest first, locked (FOR UPDATE SKIP LOCKED: instances
// another transaction holds are skipped).
func ClaimDueSagas(ctx context.Context, q Querier, typ string, limit int) ([]SagaInstance, error) {
	var out []SagaInstance
	err := q.Query(ctx, S(`SELECT `+sagaInstanceColumns+` FROM millwright_saga_instances
		WHERE type = $1 AND deadline_at <= now()
		ORDER BY deadline_at LIMIT $2 FOR UPDATE SKIP LOCKED`, typ, limit), func(r Row) error {
		var in SagaInstance
		err := r.Scan(in.dest()...)
		out = append(out, in)
		return err
	})
	return out, err
}

// SagaFactsQuery says what SagaFacts reads from a saga's history.
type SagaFactsQuery struct {
	ID string
	// AnsweredStep, AnsweredKinds and AnsweredAttempt ask whether the
	// history holds a row of that step, one of those kinds and that
	// attempt (a reply already acted on). No kinds: not asked.
	AnsweredStep    string
	AnsweredKinds   []string
	AnsweredAttempt int
	// FinalKind asks whether the history holds a row of that kind.
	FinalKind string
	// AttemptKind asks for the highest attempt of each step among the rows
	// of that kind.
	AttemptKind string
}

// SagaFacts is what a saga's next transition may need from its history.
type SagaFacts struct {
	Answered bool
	Final    bool
	// MaxAttempt is the highest attempt by step name (absent: none).
	MaxAttempt map[string]int
}

const sagaFactsSQL = `SELECT
	EXISTS (SELECT 1 FROM millwright_saga_steps WHERE saga_id = $1 AND step = $2 AND kind = ANY($3::text[]) AND attempt = $4),
	EXISTS (SELECT 1 FROM millwright_saga_steps WHERE saga_id = $1 AND kind = $5),
	COALESCE((SELECT jsonb_object_agg(step, m) FROM (SELECT step, max(attempt) AS m FROM millwright_saga_steps
		WHERE saga_id = $1 AND kind = $6 GROUP BY step) c), '{}')::text`

// LoadSagaFacts reads, in one statement, what f asks of saga f.ID's history.
// In a transaction that locked the instance (LockSaga) and runs at read
// committed, it sees every transition committed before the lock was
// granted.
func LoadSagaFacts(ctx context.Context, q Querier, f SagaFactsQuery) (SagaFacts, error) {
	kinds := f.AnsweredKinds
	if kinds == nil {
		kinds = []string{}
	}
	var out SagaFacts
	var attempts string
	if err := q.QueryRow(ctx, S(sagaFactsSQL, f.ID, f.AnsweredStep, kinds, f.AnsweredAttempt, f.FinalKind, f.AttemptKind),
		&out.Answered, &out.Final, &attempts); err != nil {
		return out, err
	}
	if err := json.Unmarshal([]byte(attempts), &out.MaxAttempt); err != nil {
		return out, fmt.Errorf("storage: reading saga %q's attempts %q: %w", f.ID, attempts, err)
	}
	return out, nil
}

const updateSagaSQL = `UPDATE millwright_saga_instances SET
	state = $3, current_step = $4, data = $5::jsonb, version = version + 1, deadline_at = $6, awaiting_reply = $7,
	compensation_attempts = $8, compensation_started_at = $9, last_error = $10, compensation_attempt_base = $11,
	resume_step = $12, cause = $13, branches = $14::jsonb, forward_retry = $15, updated_at = now()
	WHERE id = $1 AND version = $2`

const insertSagaStepsSQL = `INSERT INTO millwright_saga_steps (saga_id, step, kind, detail, attempt, error)
	SELECT $1, u.s, u.k, u.d, u.a, NULLIF(u.e, '') FROM ` + sagaStepsFrom + ` ORDER BY u.o`

// SagaTransition returns the statements of a transition: the instance row
// written over version old (Expect 1: a row no longer at old fails the
// statement, and its batch, with a *ConflictError), then the history
// rows. Send them in one Batch, or after the commands' outbox rows with
// Queue.Flush. Data jsonb would refuse is an error wrapping
// ErrJSONBRefuses that names the field (CheckJSONB), returned
// before any statement is made: such a transition can never be written.
func SagaTransition(in SagaInstance, old int64, steps []SagaStep) ([]Statement, error) {
	if err := CheckJSONB(in.Data); err != nil {
		return nil, fmt.Errorf("storage: writing saga %q: its data: %w", in.ID, err)
	}
	ss := []Statement{{SQL: updateSagaSQL, Expect: 1, What: "writing saga instance " + in.ID + " over version " + fmt.Sprint(old),
		Args: []any{in.ID, old, in.State, in.Step, string(in.Data), sagaNullTime(in.Deadline), in.Awaiting,
			in.CompAttempts, sagaNullTime(in.CompStarted), sagaNullString(in.LastError), in.AttemptBase,
			sagaNullInt(in.ResumeStep), sagaNullString(in.Cause), sagaNullJSON(in.Branches), in.ForwardRetry}}}
	if len(steps) > 0 {
		ss = append(ss, SagaSteps(in.ID, steps))
	}
	return ss, nil
}

// SagaSteps returns the statement appending steps to saga id's history.
func SagaSteps(id string, steps []SagaStep) Statement {
	return Statement{SQL: insertSagaStepsSQL, Args: sagaStepArgs(id, steps), Expect: NoExpect,
		What: "recording saga " + id + "'s step history"}
}

// SagaInfoRow is an instance as operators list it.
type SagaInfoRow struct {
	ID, Type, State string
	StepIndex       int
	// Step is the step of the newest command, compensation or resolution
	// row of its history ("" for none).
	Step                 string
	Data                 []byte
	Version              int64
	Deadline             sql.NullTime
	AwaitingReply        bool
	CompensationAttempts int
	Cause, LastError     string
	CreatedAt, UpdatedAt time.Time
	// Branches is the branches column (nil: NULL).
	Branches []byte
}

const sagaInfoSelect = `SELECT i.id, i.type, i.state, i.current_step, i.data::text, i.version, i.deadline_at,
	i.awaiting_reply, i.compensation_attempts, COALESCE(i.cause, ''), COALESCE(i.last_error, ''), i.created_at, i.updated_at, i.branches::text,
	COALESCE((SELECT s.step FROM millwright_saga_steps s WHERE s.saga_id = i.id
		AND s.kind IN ('command', 'compensation', 'resolved', 'wait', 'timer') ORDER BY s.id DESC LIMIT 1), '')
	FROM millwright_saga_instances i`

func scanSagaInfo(r Row) (SagaInfoRow, error) {
	var in SagaInfoRow
	err := r.Scan(&in.ID, &in.Type, &in.State, &in.StepIndex, &in.Data, &in.Version, &in.Deadline,
		&in.AwaitingReply, &in.CompensationAttempts, &in.Cause, &in.LastError, &in.CreatedAt, &in.UpdatedAt, &in.Branches, &in.Step)
	return in, err
}

// ListSagas returns the instances of type typ in state state ("" for
// any), newest first, at most limit (< 0: no limit).
func ListSagas(ctx context.Context, q Querier, typ, state string, limit int) ([]SagaInfoRow, error) {
	text := sagaInfoSelect + ` WHERE ($1 = '' OR i.type = $1) AND ($2 = '' OR i.state = $2) ORDER BY i.created_at DESC, i.id`
	args := []any{typ, state}
	if limit >= 0 {
		text += ` LIMIT $3`
		args = append(args, limit)
	}
	var out []SagaInfoRow
	err := q.Query(ctx, S(text, args...), func(r Row) error {
		in, err := scanSagaInfo(r)
		out = append(out, in)
		return err
	})
	return out, err
}

// GetSaga returns instance id; no such instance is an error for which
// IsNoRows holds.
func GetSaga(ctx context.Context, q Querier, id string) (SagaInfoRow, error) {
	var in SagaInfoRow
	found := false
	err := q.Query(ctx, S(sagaInfoSelect+` WHERE i.id = $1`, id), func(r Row) error {
		var err error
		in, err = scanSagaInfo(r)
		found = true
		return err
	})
	if err == nil && !found {
		return in, sql.ErrNoRows
	}
	return in, err
}

// SagaHistoryRow is one row of a saga's step history.
type SagaHistoryRow struct {
	SagaStep
	At time.Time
}

// SagaHistory returns saga id's history, oldest first.
func SagaHistory(ctx context.Context, q Querier, id string) ([]SagaHistoryRow, error) {
	var out []SagaHistoryRow
	err := q.Query(ctx, S(`SELECT step, kind, detail, attempt, COALESCE(error, ''), at
		FROM millwright_saga_steps WHERE saga_id = $1 ORDER BY id`, id), func(r Row) error {
		var h SagaHistoryRow
		err := r.Scan(&h.Step, &h.Kind, &h.Detail, &h.Attempt, &h.Error, &h.At)
		out = append(out, h)
		return err
	})
	return out, err
}

// LockSagaResume locks instance id (FOR UPDATE) and returns its
// resume_step; no such instance is an error for which IsNoRows holds.
func LockSagaResume(ctx context.Context, q Querier, id string) (sql.NullInt64, error) {
	var resume sql.NullInt64
	err := q.QueryRow(ctx, S(`SELECT resume_step FROM millwright_saga_instances WHERE id = $1 FOR UPDATE`, id), &resume)
	return resume, err
}

const resolveSagaSQL = `UPDATE millwright_saga_instances SET state = 'compensating',
	current_step = $2, version = version + 1, deadline_at = now(), awaiting_reply = false,
	compensation_attempts = 0, compensation_started_at = NULL, resume_step = $3, updated_at = now()
	WHERE id = $1`

// ResolveSaga hands stuck saga id back to the timeout loop, due now, to
// compensate step next afresh (resume: the step the chain goes on with
// afterwards), and records the resolution (kind, detail) in its history:
// two statements in one batch. The instance must be locked
// (LockSagaResume) by q's transaction.
func ResolveSaga(ctx context.Context, q Querier, id string, next int, resume sql.NullInt64, resolved SagaStep) error {
	return q.Batch(ctx,
		Statement{SQL: resolveSagaSQL, Args: []any{id, next, sagaNullInt(resume)}, Expect: 1, What: "resolving saga " + id},
		SagaSteps(id, []SagaStep{resolved}))
}

// CountSagas returns how many instances of type typ are in state. It reads
// the (type, state) index.
func CountSagas(ctx context.Context, q Querier, typ, state string) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM millwright_saga_instances WHERE type = $1 AND state = $2`, typ, state), &n)
	return n, err
}

// SagaTables are the tables an orchestrator works on.
var SagaTables = []string{"millwright_saga_instances", "millwright_saga_steps"}

func sagaNullTime(t sql.NullTime) any {
	if !t.Valid {
		return nil
	}
	return t.Time
}

func sagaNullString(s sql.NullString) any {
	if !s.Valid {
		return nil
	}
	return s.String
}

func sagaNullInt(n sql.NullInt64) any {
	if !n.Valid {
		return nil
	}
	return n.Int64
}

func sagaNullJSON(b []byte) any {
	if b == nil {
		return nil
	}
	return string(b)
}

// SagaForwardRetry reports whether instance id's current round is a
// Retriable step's command (forward_retry); no such instance is an error
// for which IsNoRows holds.
func SagaForwardRetry(ctx context.Context, q Querier, id string) (bool, error) {
	var fwd bool
	err := q.QueryRow(ctx, S(`SELECT forward_retry FROM millwright_saga_instances WHERE id = $1`, id), &fwd)
	return fwd, err
}

const resolveSagaForwardSQL = `UPDATE millwright_saga_instances SET state = 'running',
	version = version + 1, deadline_at = now(), awaiting_reply = false,
	compensation_attempt_base = compensation_attempt_base + GREATEST(compensation_attempts, 1),
	compensation_attempts = 0, compensation_started_at = NULL, forward_retry = $2, updated_at = now()
	WHERE id = $1`

// ResolveSagaForward hands saga id, stuck on a Retriable step's command,
// back to the timeout loop, due now: retry true sends the command again
// in a fresh round of attempts (numbered after the earlier ones); false
// (skip) takes the step as done and goes on with the next one. It records
// the resolution in the history: two statements in one batch. The instance
// must be locked by q's transaction.
func ResolveSagaForward(ctx context.Context, q Querier, id string, retry bool, resolved SagaStep) error {
	return q.Batch(ctx,
		Statement{SQL: resolveSagaForwardSQL, Args: []any{id, retry}, Expect: 1, What: "resolving saga " + id},
		SagaSteps(id, []SagaStep{resolved}))
}
