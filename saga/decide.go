package saga

import (
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// The orchestrator's decisions are pure: decide computes what an input (a
// reply, a passed deadline) does to an instance, from the instance, the
// input, what the saga's history says (history) and the time, with no I/O.
// The orchestrator loads what a decision needs, decides, and writes the
// transition, in one transaction (orchestrator.go, store.go).

// instance is a row of millwright_saga_instances.
type instance struct {
	id           string
	typ          string
	state        State
	step         int
	data         []byte
	version      int64
	deadline     sql.NullTime
	awaiting     bool
	compAttempts int
	compStarted  sql.NullTime
	lastError    sql.NullString
	createdAt    time.Time
	// attemptBase + compAttempts is the current compensation's attempt
	// number on the wire (metadata.SagaAttempt).
	attemptBase int
	// resumeStep, while a late success's compensation runs, is where the
	// compensation chain goes on afterwards.
	resumeStep sql.NullInt64
	// cause is why the saga is compensating.
	cause sql.NullString
	// branches is the state of each branch of the groups entered, by
	// branch name (group.go); never mutated in place (decisions clone it).
	branches map[string]BranchInfo
	// forwardRetry: the round (compAttempts, compStarted, attemptBase)
	// counts a Retriable step's command attempts (wait.go).
	forwardRetry bool
}

// attempt is the wire attempt number of the current compensation.
func (in instance) attempt() int { return in.attemptBase + in.compAttempts }

// fail records why the saga starts compensating.
func (in *instance) fail(reason string) {
	in.cause = sql.NullString{String: reason, Valid: true}
	in.lastError = in.cause
}

// since is last_error while compensating: the cause that started the
// compensation, then what happened since. Sagas from before the cause
// column have only what.
func (in instance) since(what string) sql.NullString {
	if !in.cause.Valid || in.cause.String == "" || in.cause.String == what {
		return sql.NullString{String: what, Valid: true}
	}
	return sql.NullString{String: in.cause.String + "; then " + what, Valid: true}
}

// histRow is one row of millwright_saga_steps.
type histRow struct {
	step, kind, detail string
	attempt            int
	err                string
}

// noteKind is something a transition did that the orchestrator reports
// (metrics, logs) once it is written.
type noteKind int

const (
	noteCompleted noteKind = iota + 1
	// noteCompensated: compensated for the first time (a saga a late
	// success reopened was counted when it was first compensated).
	noteCompensated
	noteStuck
	noteTimeout
	// noteIgnored: a reply recorded and ignored (kind late_reply or
	// duplicate).
	noteIgnored
	noteLateSuccess
	// noteSetAside: no decision could be made on the instance (its
	// position is not in the definition, or the definition's code
	// panicked); it is stuck for an operator. reply holds the reason.
	noteSetAside
)

// note is one report of a transition.
type note struct {
	what noteKind
	step string
	// kind of an ignored reply; phase, attempt and reply type of a reply;
	// state of the instance before the transition.
	kind, phase, reply string
	attempt            int
	state              State
}

// transition is what one input does to an instance: the new row, its
// history and commands, written together, and what to report once they
// are. A transition whose in.version is 0 only records history.
type transition struct {
	in     instance
	hist   []histRow
	events []outbox.Event
	notes  []note
}

func (t *transition) record(step, kind, detail string, attempt int, err string) {
	t.hist = append(t.hist, histRow{step: step, kind: kind, detail: detail, attempt: attempt, err: err})
}

func (t *transition) note(n note) { t.notes = append(t.notes, n) }

// has reports whether t carries a note of kind k.
func (t *transition) has(k noteKind) bool {
	for _, n := range t.notes {
		if n.what == k {
			return true
		}
	}
	return false
}

// input is what a decision reacts to: a reply, or (deadline) the passed
// deadline of the instance.
type input struct {
	deadline bool
	reply    replyInfo
}

// replyInfo is what a reply message says about itself (parseReply).
type replyInfo struct {
	sagaID, step, phase string
	attempt             int
	reply               Reply
	stepIdx             int
}

// history is what a decision may need of the saga's step history, read in
// the transaction that locked the instance (storage.LoadSagaFacts).
type history struct {
	// loaded is false when the orchestrator has not read the history: a
	// decision that needs it returns errNeedHistory, and the orchestrator
	// reads it and decides again. Most transitions (a success sending the
	// next command) need none, and cost no read.
	loaded bool
	// answered: the history records an answer to the reply's command (its
	// reply, or, for a forward reply, a late success acted on).
	answered bool
	// compensated: the saga was compensated before.
	compensated bool
	// compAttempts is the highest attempt each step's compensation was
	// ever sent with, by step name.
	compAttempts map[string]int
}

// errNeedHistory is returned by a decision that needs the history when
// history.loaded is false.
var errNeedHistory = errors.New("saga: the decision needs the step history")

// decider makes the decisions of one saga type.
type decider[D any] struct {
	def *Definition[D]
	cfg Config // ReplyTopic, ReplyShards and Source
}

// replyTopicFor returns the reply topic of saga sagaID: one of
// ReplyTopics, the same for every command of the saga.
func (d decider[D]) replyTopicFor(sagaID string) string {
	if d.cfg.ReplyShards <= 1 {
		return d.cfg.ReplyTopic
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(sagaID))
	return replyShard(d.cfg.ReplyTopic, int(h.Sum32()%uint32(d.cfg.ReplyShards)))
}

// decideStart is the transition of a new saga: its instance (version 0,
// not yet written) with the first step's command.
func (d decider[D]) decideStart(id string, data D, now time.Time) (*transition, error) {
	raw, err := json.Marshal(data)
	if err != nil {
		return nil, fmt.Errorf("marshalling data %T: %w", data, err)
	}
	t := &transition{in: instance{id: id, typ: d.def.name, state: StateRunning, data: raw, awaiting: true, createdAt: now}}
	if err := d.sendCommand(t, 0, data, now); err != nil {
		return nil, err
	}
	return t, nil
}

// ErrUnknownPosition is returned (wrapped) by a decision on an instance
// whose position (its current step, or the step its compensation chain
// resumes at) is not a step of the saga's definition: the definition lost
// steps while the saga ran. The orchestrator sets such an instance aside as
// stuck, with the error as its last_error, instead of deciding on it.
var ErrUnknownPosition = errors.New("saga: the instance's position is not a step of its definition")

// checkPosition refuses an instance whose position indexes no step of the
// definition. A completed saga's step is never read again.
func (d decider[D]) checkPosition(in instance) error {
	n := len(d.def.steps)
	bad := func(what string, i int64) error {
		return fmt.Errorf("saga %s %q: %s is step index %d, but the definition has %d step(s) (0..%d): %w; "+
			"was a step removed from the definition while the saga ran? Restore the step, or compensate the saga by hand "+
			"and record it with `millwright saga resolve %s --action skip`", d.def.name, in.id, what, i, n, n-1, ErrUnknownPosition, in.id)
	}
	if in.state != StateCompleted && (in.step < -1 || in.step >= n) {
		return bad("current_step", int64(in.step))
	}
	if in.resumeStep.Valid && (in.resumeStep.Int64 < -1 || in.resumeStep.Int64 >= int64(n)) {
		return bad("resume_step", in.resumeStep.Int64)
	}
	return nil
}

// decide computes what inp does to instance in, given h, at now. An
// instance whose position is not in the definition is refused
// (ErrUnknownPosition), never indexed.
func (d decider[D]) decide(in instance, inp input, h history, now time.Time) (*transition, error) {
	if err := d.checkPosition(in); err != nil {
		return nil, err
	}
	if inp.deadline {
		return d.onDeadline(in, h, now)
	}
	return d.onReply(in, inp.reply, h, now)
}

// sendCommand makes step i's command current.
func (d decider[D]) sendCommand(t *transition, i int, data D, now time.Time) error {
	if g, ok := d.def.groupAt(i); ok {
		return d.sendGroup(t, g, data, now)
	}
	if ok, err := d.enterStep(t, i, data, now); ok { // wait.go: waiting, timer, Retriable
		return err
	}
	s := d.def.steps[i]
	cmd, err := s.Command(data)
	if err != nil {
		return fmt.Errorf("step %q: building command: %w", s.Name, err)
	}
	ev, err := d.event(t.in.id, s.Name, PhaseForward, 1, cmd)
	if err != nil {
		return fmt.Errorf("step %q: %w", s.Name, err)
	}
	t.in.state, t.in.step, t.in.awaiting = StateRunning, i, true
	t.in.deadline = sql.NullTime{Time: now.Add(s.Timeout), Valid: true}
	t.events = append(t.events, ev)
	t.record(s.Name, KindCommand, cmd.Type, 1, "")
	return nil
}

// event turns a command into an outbox event carrying the saga keys.
func (d decider[D]) event(sagaID, step, phase string, attempt int, cmd Command) (outbox.Event, error) {
	if cmd.Topic == "" {
		return outbox.Event{}, errors.New("command has no Topic: set Command.Topic to the participant's command topic")
	}
	// The outbox and the history store them as text: Postgres would
	// refuse the whole batch of the transition (and with it the round of
	// every saga of the type).
	for _, f := range [...]struct{ name, v string }{{"Topic", cmd.Topic}, {"Type", cmd.Type}} {
		if !utf8.ValidString(f.v) {
			return outbox.Event{}, fmt.Errorf("command %s %q is not valid UTF-8, which Postgres text cannot store: use a text %s", f.name, f.v, strings.ToLower(f.name))
		}
	}
	var payload []byte
	switch p := cmd.Payload.(type) {
	case []byte:
		payload = p
	case json.RawMessage:
		payload = p
	default:
		var err error
		if payload, err = json.Marshal(p); err != nil {
			return outbox.Event{}, fmt.Errorf("marshalling command payload %T: %w", p, err)
		}
	}
	md := make(map[string]string, len(cmd.Metadata)+6)
	for k, v := range cmd.Metadata {
		md[k] = v
	}
	md[metadata.SagaID] = sagaID
	md[metadata.SagaType] = d.def.name
	md[metadata.SagaStep] = step
	md[metadata.SagaPhase] = phase
	md[metadata.SagaAttempt] = strconv.Itoa(attempt)
	md[metadata.SagaReplyTo] = d.replyTopicFor(sagaID)
	return outbox.Event{
		Topic:         cmd.Topic,
		AggregateType: "saga",
		AggregateID:   sagaID,
		EventType:     cmd.Type,
		Payload:       payload,
		Metadata:      md,
		Source:        d.cfg.Source,
	}, nil
}

func (d decider[D]) decode(in instance) (D, error) {
	var data D
	if err := json.Unmarshal(in.data, &data); err != nil {
		return data, fmt.Errorf("saga %s %q: decoding data into %T: %w", d.def.name, in.id, data, err)
	}
	return data, nil
}

// current reports whether r answers the command instance in waits for,
// and the history kind of r.
func (d decider[D]) current(in instance, r replyInfo) (bool, string) {
	current := in.step == r.stepIdx && in.awaiting
	if r.phase == PhaseForward {
		return current && in.state == StateRunning, KindReply
	}
	return current && in.state == StateCompensating && in.attempt() == r.attempt, KindCompensationReply
}

// answeredKinds are the history kinds that mean reply r's command was
// answered: its reply kind, and for a forward reply a late success acted
// on (so a second success reply of the command sends nothing again).
func answeredKinds(r replyInfo) []string {
	if r.phase == PhaseForward {
		return []string{KindReply, KindLateSuccess}
	}
	return []string{KindCompensationReply}
}

// onReply computes what reply r does to instance in.
func (d decider[D]) onReply(in instance, r replyInfo, h history, now time.Time) (*transition, error) {
	if t, ok, err := d.groupReply(in, r, h, now); ok {
		return t, err
	}
	if t, ok, err := d.onRetriableReply(in, r, h, now); ok { // wait.go
		return t, err
	}
	if ok, _ := d.current(in, r); !ok {
		return d.onStaleReply(in, r, h, now)
	}
	s := d.def.steps[r.stepIdx]
	t := &transition{in: in}
	data, err := d.decode(in)
	if err != nil {
		return nil, err
	}
	switch r.reply.Type {
	case s.SuccessReply:
		err = d.onSuccess(t, r, data, h, now)
	case s.FailureReply:
		e := replyError(r.reply)
		t.record(s.Name, KindReply, r.reply.Type, r.attempt, e)
		t.in.fail(fmt.Sprintf("step %q failed: %s", s.Name, e))
		err = d.compensateFrom(t, r.stepIdx-1, data, h, now)
	case s.CompensatedReply:
		t.record(s.Name, KindCompensationReply, r.reply.Type, r.attempt, "")
		next := r.stepIdx - 1
		if in.resumeStep.Valid {
			// This was a late success's compensation: go on with the
			// compensation it interrupted (or back to compensated).
			next, t.in.resumeStep = int(in.resumeStep.Int64), sql.NullInt64{}
		}
		err = d.compensateFrom(t, next, data, h, now)
	case s.CompensationFailedReply:
		e := replyError(r.reply)
		t.record(s.Name, KindCompensationReply, r.reply.Type, r.attempt, e)
		d.compensationFailed(t, fmt.Sprintf("compensation of step %q failed (attempt %d): %s", s.Name, r.attempt, e), now)
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

// onSuccess is the current step's success: the next command, or the saga
// completed.
func (d decider[D]) onSuccess(t *transition, r replyInfo, data D, h history, now time.Time) error {
	s := d.def.steps[r.stepIdx]
	t.record(s.Name, KindReply, r.reply.Type, r.attempt, "")
	if err := d.applySuccess(t, s, &data, r); err != nil {
		return err
	}
	if r.stepIdx+1 == len(d.def.steps) {
		t.in.state, t.in.deadline = StateCompleted, sql.NullTime{}
		t.record(s.Name, KindCompleted, "", 0, "")
		t.note(note{what: noteCompleted, step: s.Name})
		return nil
	}
	if err := d.sendCommand(t, r.stepIdx+1, data, now); err != nil {
		// The next step cannot even be asked: it fails, and the steps
		// done so far (this one included) are compensated.
		msg := err.Error()
		t.record(d.def.steps[r.stepIdx+1].Name, KindCommand, "", 1, msg)
		t.in.fail(msg)
		return d.compensateFrom(t, r.stepIdx, data, h, now)
	}
	return nil
}

// onStaleReply is a reply to a command that is not current: a late
// success to undo, or a late or duplicate reply, recorded and ignored.
func (d decider[D]) onStaleReply(in instance, r replyInfo, h history, now time.Time) (*transition, error) {
	if !h.loaded {
		return nil, errNeedHistory
	}
	s := d.def.steps[r.stepIdx]
	// Forward commands are sent once, in order, so an unanswered one
	// that is not current timed out: the saga is compensating (at this
	// step or an earlier one), compensated, or stuck.
	if !h.answered && r.phase == PhaseForward && r.reply.Type == s.SuccessReply && s.Compensation != nil &&
		in.step <= r.stepIdx && (in.state == StateCompensating || in.state == StateCompensated || in.state == StateStuck) &&
		d.lateSuccessPossible(in, r.stepIdx) {
		return d.onLateSuccess(in, r, h, now)
	}
	kind := KindLateReply
	if h.answered {
		kind = KindDuplicate
	}
	t := &transition{in: instance{id: in.id}}
	t.record(s.Name, kind, r.reply.Type, r.attempt, "")
	t.note(note{what: noteIgnored, step: s.Name, kind: kind, phase: r.phase, reply: r.reply.Type, attempt: r.attempt, state: in.state})
	return t, nil
}

// applySuccess updates the saga data from step s's success reply.
func (d decider[D]) applySuccess(t *transition, s Step[D], data *D, r replyInfo) error {
	if s.OnSuccess == nil {
		return nil
	}
	if err := s.OnSuccess(data, r.reply); err != nil {
		return fmt.Errorf("saga %s %q: step %q OnSuccess: %w", d.def.name, t.in.id, s.Name, err)
	}
	var err error
	if t.in.data, err = json.Marshal(*data); err != nil {
		return fmt.Errorf("saga %s %q: marshalling data %T: %w", d.def.name, t.in.id, *data, err)
	}
	return nil
}

// onLateSuccess undoes a step whose success arrived after it timed out:
// its effect happened although the saga gave up on it, and whatever its
// participant made of the compensation sent at the timeout (it may have
// run first, finding nothing to undo), only a compensation sent after the
// success is sure to find the effect. So the step's compensation is sent
// now, in this transition (the history row, the instance row and the
// command commit together, or the reply is redelivered). If another step's
// compensation was current, or none was left, the late one goes first and
// the chain resumes there afterwards: a compensated saga is compensating
// again until the late step is undone, then compensated again (counted
// once).
func (d decider[D]) onLateSuccess(in instance, r replyInfo, h history, now time.Time) (*transition, error) {
	s := d.def.steps[r.stepIdx]
	t := &transition{in: in}
	data, err := d.decode(in)
	if err != nil {
		return nil, err
	}
	t.record(s.Name, KindLateSuccess, r.reply.Type, r.attempt, "")
	// The compensation may need what the reply says (a reservation id).
	if err := d.applySuccess(t, s, &data, r); err != nil {
		return nil, err
	}
	if in.step != r.stepIdx {
		t.in.resumeStep = sql.NullInt64{Int64: int64(in.step), Valid: true}
	}
	t.in.lastError = in.since(fmt.Sprintf("step %q succeeded after it timed out: undoing it", s.Name))
	if err := d.compensateFrom(t, r.stepIdx, data, h, now); err != nil {
		return nil, err
	}
	t.note(note{what: noteLateSuccess, step: s.Name, state: in.state})
	return t, nil
}

// maxReplyErrorBytes bounds the failure text a reply puts in last_error
// and the history.
const maxReplyErrorBytes = 1024

// replyError is the failure reason a reply carries, made storable: the
// participant's text may be binary, hold NUL bytes or be cut mid-rune,
// and Postgres refuses such text, which would fail the reply on every
// redelivery.
func replyError(r Reply) string {
	e := r.Metadata[metadata.SagaError]
	if e == "" && len(r.Payload) > 0 {
		e = string(r.Payload)
	}
	if e == "" {
		return r.Type
	}
	return truncate(storableText(e), maxReplyErrorBytes)
}

// storableText returns s as valid UTF-8 without NUL bytes.
func storableText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// truncate cuts s to at most n bytes on a rune boundary, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// compensateFrom starts compensating at step i and below: the first step at
// or below i that has a compensation gets its command; with none left the
// saga is compensated. It needs the history.
func (d decider[D]) compensateFrom(t *transition, i int, data D, h history, now time.Time) error {
	if !h.loaded {
		return errNeedHistory
	}
	if i >= len(d.def.steps) {
		return fmt.Errorf("saga %s %q: compensating from step index %d, but the definition has %d step(s): %w", d.def.name, t.in.id, i, len(d.def.steps), ErrUnknownPosition)
	}
	for ; i >= 0 && !d.compensable(t.in, i); i-- {
	}
	t.in.compAttempts, t.in.compStarted, t.in.attemptBase = 0, sql.NullTime{}, 0
	if i < 0 {
		t.in.state, t.in.step, t.in.deadline, t.in.awaiting = StateCompensated, -1, sql.NullTime{}, false
		t.in.resumeStep = sql.NullInt64{}
		if t.in.cause.Valid {
			t.in.lastError = t.in.cause
		}
		t.record("", KindCompensated, "", 0, "")
		if !h.compensated {
			t.note(note{what: noteCompensated})
		}
		return nil
	}
	// A step's compensation may run more than once (a late success, an
	// operator's retry): number the new round's attempts after every
	// earlier one, so that a reply to an earlier attempt (one that ran
	// before a late effect, say) is never taken for this round's answer.
	s := d.def.steps[i]
	t.in.attemptBase = h.compAttempts[s.Name]
	t.in.state, t.in.step = StateCompensating, i
	d.sendCompensation(t, data, now)
	return nil
}

// sendCompensation sends the next attempt of the current step's
// compensation.
func (d decider[D]) sendCompensation(t *transition, data D, now time.Time) {
	s := d.def.steps[t.in.step]
	t.in.compAttempts++
	attempt := t.in.attempt()
	if !t.in.compStarted.Valid {
		t.in.compStarted = sql.NullTime{Time: now, Valid: true}
	}
	cmd, err := s.Compensation(data)
	var ev outbox.Event
	if err == nil {
		ev, err = d.event(t.in.id, s.Name, PhaseCompensation, attempt, cmd)
	}
	if err != nil {
		msg := fmt.Sprintf("compensation of step %q (attempt %d): building command: %v", s.Name, attempt, err)
		t.record(s.Name, KindCompensation, "", attempt, msg)
		d.compensationFailed(t, msg, now)
		return
	}
	t.events = append(t.events, ev)
	t.record(s.Name, KindCompensation, cmd.Type, attempt, "")
	t.in.awaiting = true
	t.in.deadline = sql.NullTime{Time: now.Add(s.CompensationTimeout), Valid: true}
}

// compensationFailed schedules the next attempt of the current compensation
// after its backoff, or makes the saga stuck when the budget is spent. The
// saga's last_error keeps the cause and adds reason.
func (d decider[D]) compensationFailed(t *transition, reason string, now time.Time) {
	s := d.def.steps[t.in.step]
	t.in.lastError = t.in.since(reason)
	if s.Retry.Exhausted(t.in.compAttempts, now.Sub(t.in.compStarted.Time)) {
		t.in.state, t.in.deadline, t.in.awaiting = StateStuck, sql.NullTime{}, false
		t.record(s.Name, KindStuck, "", t.in.attempt(), reason)
		t.note(note{what: noteStuck, step: s.Name, attempt: t.in.compAttempts})
		return
	}
	t.in.awaiting = false
	t.in.deadline = sql.NullTime{Time: now.Add(s.Retry.Delay(t.in.compAttempts, 0)), Valid: true}
}

// setAside makes instance in stuck for an operator, because no decision
// could be made on it (reason: an ErrUnknownPosition, or a panic of the
// definition's code), or the one made can never be written
// (setAsideRefused). The deadline is cleared, so that the orchestrators
// stop firing it; `millwright saga list --state stuck` lists it, and
// last_error says why.
func (d decider[D]) setAside(in instance, reason string) *transition {
	reason = truncate(storableText(reason), maxReplyErrorBytes)
	t := &transition{in: in}
	t.in.state, t.in.deadline, t.in.awaiting = StateStuck, sql.NullTime{}, false
	t.in.lastError = in.since("set aside: " + reason)
	step := ""
	if in.step >= 0 && in.step < len(d.def.steps) {
		step = d.def.steps[in.step].Name
	}
	t.record(step, KindStuck, "", in.attempt(), reason)
	t.note(note{what: noteSetAside, step: step, reply: reason, state: in.state})
	return t
}

// setAsideRefused makes instance in stuck for an operator instead of
// writing transition t, its decided transition, which can never be
// written (reason: outbox refused one of its commands, or jsonb its data).
// The instance keeps what t decided (its position, cause, resume step,
// and its data unless keepData is false: then in's, the row as read) but
// sends nothing: t's history is kept without the rows of its commands,
// which were not sent (so a reply t answered is recorded, and its
// redelivery is a duplicate, not a late success), then a stuck row says
// why.
func (d decider[D]) setAsideRefused(in instance, t *transition, reason string, keepData bool) *transition {
	base := t.in
	if base.version == 0 { // t only recorded history
		base = in
	}
	if !keepData {
		base.data = in.data
	}
	var kept []histRow
	for _, r := range t.hist {
		switch r.kind {
		case KindCompensation:
			base.compAttempts = max(0, base.compAttempts-1) // not sent
		case KindCommand:
		default:
			kept = append(kept, r)
		}
	}
	aside := d.setAside(base, reason)
	aside.hist = append(kept, aside.hist...)
	return aside
}

// onDeadline computes what a passed deadline does to instance in.
func (d decider[D]) onDeadline(in instance, h history, now time.Time) (*transition, error) {
	t := &transition{in: in}
	data, err := d.decode(in)
	if err != nil {
		// Undecodable data: the saga cannot go on; park it for an
		// operator rather than retrying it every round.
		t.in.state, t.in.deadline = StateStuck, sql.NullTime{}
		t.in.lastError = sql.NullString{String: err.Error(), Valid: true}
		t.record("", KindStuck, "", 0, err.Error())
		t.note(note{what: noteStuck})
		return t, nil
	}
	if ok, err := d.groupDeadline(t, data, h, now); ok {
		if err != nil {
			return nil, err
		}
		return t, nil
	}
	switch {
	case in.state == StateRunning && d.waitDeadline(in): // wait.go: timer, Retriable, skipped
		err = d.onWaitDeadline(t, data, h, now)
	case in.state == StateRunning:
		s := d.def.steps[in.step]
		msg := fmt.Sprintf("step %q timed out after %s", s.Name, s.Timeout)
		t.record(s.Name, KindTimeout, "", 1, msg)
		t.in.fail(msg)
		// The step's outcome is unknown: it may have taken effect and its
		// reply be late. Its own compensation runs too; should its
		// success still arrive, onLateSuccess sends the compensation
		// again. Compensations must therefore accept commands whose
		// forward effect never happened.
		t.note(note{what: noteTimeout, step: s.Name})
		err = d.compensateFrom(t, in.step, data, h, now)
	case in.state == StateCompensating && in.step < 0:
		err = d.compensateFrom(t, -1, data, h, now)
	case in.state == StateCompensating && in.awaiting:
		s := d.def.steps[in.step]
		msg := fmt.Sprintf("compensation of step %q (attempt %d) timed out after %s", s.Name, in.attempt(), s.CompensationTimeout)
		t.record(s.Name, KindTimeout, "", in.attempt(), msg)
		d.compensationFailed(t, msg, now)
	case in.state == StateCompensating && in.compAttempts == 0:
		// Resolved by an operator: start afresh at the current step.
		err = d.compensateFrom(t, in.step, data, h, now)
	case in.state == StateCompensating:
		d.sendCompensation(t, data, now)
	default:
		// Final or stuck states have no deadline; clear a stray one.
		t.in.deadline = sql.NullTime{}
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}
