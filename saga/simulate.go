package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/sagasim"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// The simulator's engine (sagatest.Simulator): the orchestrator's tables
// held in memory, and every input applied as the orchestrator applies it,
// through the same decider: load (the instance; its history only when the
// decision asks for it, answered as storage.LoadSagaFacts answers it),
// decide (panics recovered; an undecidable instance set aside by a
// deadline, refused by a reply), write (the row, its history, its
// commands; data jsonb refuses sets the instance aside instead). What it
// does not check is the outbox Writer's refusal of a command (its size
// and CloudEvents checks) and a version conflict, which needs two
// orchestrators.

func init() {
	sagasim.New = func(def, cfg any) (sagasim.Engine, error) {
		s, ok := def.(interface {
			simulate(Config) (sagasim.Engine, error)
		})
		if !ok || isNil(def) {
			return nil, fmt.Errorf("saga: simulating %T: want a *saga.Definition built with saga.Define", def)
		}
		c, ok := cfg.(Config)
		if !ok {
			return nil, fmt.Errorf("saga: simulating: config %T is not a saga.Config", cfg)
		}
		return s.simulate(c)
	}
}

// simulate returns an engine running d's instances with cfg. Retry
// backoffs are taken without jitter, at their full exponential delay, so
// that a simulated clock is reproducible (the orchestrator draws a part
// of that delay at random).
func (d *Definition[D]) simulate(cfg Config) (sagasim.Engine, error) {
	cfg.setDefaults(d.name)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// A copy of d with its own steps (and its own once for the
	// fingerprint, computed again: retry policies are not part of it).
	def := Definition[D]{name: d.name, index: d.index, groups: d.groups, v: defVersion{version: d.v.version}}
	def.steps = make([]Step[D], len(d.steps))
	for i, s := range d.steps {
		s.Retry.Jitter = retry.JitterNone
		def.steps[i] = s
	}
	guard, err := runner.NewGuard("saga.Simulator", nil, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	return &simEngine[D]{d: decider[D]{def: &def, cfg: cfg}, guard: guard, sagas: map[string]*simSaga{}}, nil
}

// simEngine is an in-memory orchestrator of one saga type.
type simEngine[D any] struct {
	d     decider[D]
	guard *runner.Guard
	sagas map[string]*simSaga
	ids   []string
	cmds  []sagasim.Command
	waits []sagasim.Wait
	// replies numbers the replies, naming them in errors.
	replies int
}

// simSaga is an instance row and its history rows.
type simSaga struct {
	in        instance
	hist      []storage.SagaStep
	at        []time.Time // when each history row was written
	updatedAt time.Time
}

func (e *simEngine[D]) name() string { return e.d.def.name }

func (e *simEngine[D]) Steps() []string { return e.d.def.Steps() }

// Start is Orchestrator.Start on memory.
func (e *simEngine[D]) Start(id string, data any, now time.Time) error {
	v, ok := data.(D)
	if !ok {
		var want D
		return fmt.Errorf("saga %s: Start(%q): data is %T, want %T", e.name(), id, data, want)
	}
	if id == "" {
		return errors.New("saga: Start: empty saga id: pass a unique id, e.g. the order id or a UUID")
	}
	if storableText(id) != id {
		return fmt.Errorf("saga %s: Start(%q): the id is not valid UTF-8 or holds a NUL byte, which Postgres text cannot store: use a text id (e.g. the order id or a UUID)", e.name(), id)
	}
	var t *transition
	err := e.guard.Do("starting a saga", nil, func() (err error) {
		t, err = e.d.decideStart(id, v, now)
		return err
	})
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", e.name(), id, err)
	}
	if err := storage.CheckJSONB(t.in.data); err != nil {
		return fmt.Errorf("saga %s: Start(%q): its data: %w", e.name(), id, err)
	}
	if _, dup := e.sagas[id]; dup {
		return fmt.Errorf("saga %s: Start(%q): %w", e.name(), id, ErrAlreadyStarted)
	}
	s := &simSaga{}
	e.sagas[id] = s
	e.ids = append(e.ids, id)
	e.write(s, t, now)
	return nil
}

// Reply is Orchestrator.HandleReply on memory, of the message a
// participant would send with r.
func (e *simEngine[D]) Reply(r sagasim.Reply, now time.Time) (sagasim.Reply, error) {
	if err := e.fillReply(&r); err != nil {
		return r, err
	}
	e.replies++
	body := r.Payload
	if body == nil {
		body = []byte("{}") // as saga.NewReply sends a nil payload
	}
	msg := message.NewMessage("sim-reply-"+strconv.Itoa(e.replies), body)
	for k, v := range map[string]string{metadata.SagaID: r.SagaID, metadata.SagaType: e.name(), metadata.SagaStep: r.Step,
		metadata.SagaPhase: r.Phase, metadata.SagaAttempt: strconv.Itoa(r.Attempt), metadata.SagaReplyType: r.Type,
		metadata.EventType: r.Type, metadata.EventID: msg.UUID} {
		msg.Metadata.Set(k, v)
	}
	if r.Error != "" {
		msg.Metadata.Set(metadata.SagaError, r.Error)
	}
	return e.ReplyMessage(msg, now)
}

// ReplyMessage is Orchestrator.HandleReply on memory: msg is parsed and
// checked as a message from the transport is.
func (e *simEngine[D]) ReplyMessage(msg *message.Message, now time.Time) (sagasim.Reply, error) {
	ri, err := e.d.parseReply(msg)
	r := sagasim.Reply{SagaID: ri.sagaID, Step: ri.step, Phase: ri.phase, Attempt: ri.attempt, Type: ri.reply.Type,
		Payload: msg.Payload, Error: msg.Metadata.Get(metadata.SagaError)}
	if err != nil {
		return r, err
	}
	s, ok := e.sagas[ri.sagaID]
	if !ok {
		return r, fmt.Errorf("saga %s: reply for %q: %w (was it started?)", e.name(), ri.sagaID, ErrNotFound)
	}
	t, err := e.decide(s, input{reply: ri}, now)
	if err != nil {
		return r, fmt.Errorf("saga %s: reply %s to step %q of %q: %w", e.name(), ri.reply.Type, ri.step, ri.sagaID, err)
	}
	if err := checkData(t); err != nil {
		reason := fmt.Sprintf("reply %s to step %q (attempt %d): %s", ri.reply.Type, ri.step, ri.attempt, simRefusal(ri.sagaID, err))
		t = e.d.setAsideRefused(s.in, t, reason, false)
	}
	e.write(s, t, now)
	return r, nil
}

// Signal is Orchestrator.Signal on memory, or with transport the
// delivery of Orchestrator.SignalEvent's event through HandleReply.
func (e *simEngine[D]) Signal(id, eventType string, payload any, transport bool, now time.Time) error {
	r, err := e.d.signalReply(id, eventType, payload)
	if err != nil {
		return err
	}
	if transport {
		e.replies++
		msg := message.NewMessage("sim-event-"+strconv.Itoa(e.replies), r.reply.Payload)
		for k, v := range r.reply.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.Metadata.Set(metadata.EventID, msg.UUID)
		msg.Metadata.Set(metadata.EventType, eventType)
		_, err := e.ReplyMessage(msg, now)
		return err
	}
	s, ok := e.sagas[id]
	if !ok {
		return fmt.Errorf("saga %s: Signal(%q, %q): %w", e.name(), id, eventType, ErrNotFound)
	}
	if err := e.d.waiting(s.in, r); err != nil {
		return err
	}
	t, err := e.decide(s, input{reply: r}, now)
	if err != nil {
		return fmt.Errorf("saga %s: event %s for step %q of %q: %w", e.name(), eventType, r.step, id, err)
	}
	if err := checkData(t); err != nil {
		reason := fmt.Sprintf("reply %s to step %q (attempt %d): %s", eventType, r.step, r.attempt, simRefusal(id, err))
		t = e.d.setAsideRefused(s.in, t, reason, false)
	}
	e.write(s, t, now)
	return nil
}

// Waits returns the waits begun, oldest first: the engine's own slice, to
// read only.
func (e *simEngine[D]) Waits() []sagasim.Wait { return e.waits }

// fillReply completes r's phase (from its type), type (from its phase)
// and attempt (the newest command of its step in that phase), naming what
// does not fit.
func (e *simEngine[D]) fillReply(r *sagasim.Reply) error {
	if _, ok := e.sagas[r.SagaID]; !ok {
		return fmt.Errorf("saga %s: reply for %q: %w (was it started?)", e.name(), r.SagaID, ErrNotFound)
	}
	i, ok := e.d.def.index[r.Step]
	if !ok {
		return fmt.Errorf("saga %s %q: reply names unknown step %q: want one of %s", e.name(), r.SagaID, r.Step, strings.Join(e.Steps(), ", "))
	}
	s := e.d.def.steps[i]
	switch {
	case s.isTimer():
		return fmt.Errorf("saga %s %q: step %q is a timer step: it takes no replies (Advance the clock past it)", e.name(), r.SagaID, r.Step)
	case s.isWait() && r.Type == "" && r.Phase == PhaseForward:
		return fmt.Errorf("saga %s %q: step %q is a waiting step: it has no command to answer; deliver its event %q with Signal or SignalEvent", e.name(), r.SagaID, r.Step, s.WaitFor)
	case r.Type == "" && r.Phase == PhaseForward:
		r.Type = s.SuccessReply
		if r.Failed {
			r.Type = s.FailureReply
		}
	case r.Type == "" && r.Phase == PhaseCompensation:
		r.Type = s.CompensatedReply
		if r.Failed {
			r.Type = s.CompensationFailedReply
		}
	case r.Phase == "" && (r.Type == s.SuccessReply || r.Type == s.FailureReply):
		r.Phase = PhaseForward
	case r.Phase == "" && (r.Type == s.CompensatedReply || r.Type == s.CompensationFailedReply):
		r.Phase = PhaseCompensation
	case r.Phase == "":
		return fmt.Errorf("saga %s %q: step %q has no reply type %q: want %q, %q (its command) or %q, %q (its compensation)",
			e.name(), r.SagaID, r.Step, r.Type, s.SuccessReply, s.FailureReply, s.CompensatedReply, s.CompensationFailedReply)
	}
	if r.Attempt == 0 {
		for _, c := range e.cmds {
			if c.SagaID == r.SagaID && c.Step == r.Step && c.Phase == r.Phase {
				r.Attempt = c.Attempt
			}
		}
		if r.Attempt == 0 {
			return fmt.Errorf("saga %s %q: no %s command of step %q was sent: there is nothing to reply %q to", e.name(), r.SagaID, r.Phase, r.Step, r.Type)
		}
	}
	return nil
}

// Due returns the earliest deadline at or before limit; of equal ones, the
// saga started first.
func (e *simEngine[D]) Due(limit time.Time) (string, time.Time, bool) {
	var id string
	var at time.Time
	for _, i := range e.ids {
		dl := e.sagas[i].in.deadline
		if dl.Valid && !dl.Time.After(limit) && (id == "" || dl.Time.Before(at)) {
			id, at = i, dl.Time
		}
	}
	return id, at, id != ""
}

// Fire is one instance of Orchestrator.RunOnce on memory.
func (e *simEngine[D]) Fire(id string, now time.Time) error {
	s, ok := e.sagas[id]
	if !ok {
		return fmt.Errorf("saga %s: firing the deadline of %q: %w", e.name(), id, ErrNotFound)
	}
	t, err := e.decide(s, input{deadline: true}, now)
	switch {
	case undecidable(err):
		t = e.d.setAside(s.in, err.Error())
	case err != nil:
		// Run logs it and tries again next round: the deadline stays.
		return fmt.Errorf("saga %s %q: deciding on its deadline (the orchestrator tries it again next round): %w", e.name(), id, err)
	}
	if err := checkData(t); err != nil {
		t = e.d.setAsideRefused(s.in, t, simRefusal(id, err), false)
	}
	e.write(s, t, now)
	return nil
}

// Resolve is resolveIn on memory: the stuck saga is handed back to the
// deadline loop, due now.
func (e *simEngine[D]) Resolve(id, action, note string, dryRun bool, now time.Time) (any, error) {
	a := ResolveAction(action)
	if a != ResolveRetry && a != ResolveSkip {
		return Resolution{}, fmt.Errorf("saga: Resolve %q: unknown action %q: want %q or %q", id, action, ResolveRetry, ResolveSkip)
	}
	s, ok := e.sagas[id]
	if !ok {
		return Resolution{}, fmt.Errorf("saga %q: %w", id, ErrNotFound)
	}
	r := Resolution{Info: s.info(), Action: a, DryRun: dryRun}
	if s.in.state != StateStuck {
		return r, fmt.Errorf("saga %q is %s, not stuck: only stuck sagas are resolved: %w", id, s.in.state, ErrNotStuck)
	}
	in := &s.in
	var next int
	var resume sql.NullInt64
	if in.forwardRetry {
		// Stuck on a Retriable step's command: resolveForward (its
		// description, from a dry run that writes nothing).
		dry := r
		dry.DryRun = true
		if dry, err := resolveForward(context.Background(), nil, dry, note); err == nil {
			r.Description = dry.Description
		}
	} else {
		next, resume = resolution(&r, in.resumeStep)
	}
	if dryRun {
		return r, nil
	}
	detail := action
	if note = strings.TrimSpace(note); note != "" {
		detail += ": " + note
	}
	if in.forwardRetry {
		// storage.ResolveSagaForward's row.
		in.state, in.version, in.awaiting = StateRunning, in.version+1, false
		in.deadline = sql.NullTime{Time: now, Valid: true}
		in.attemptBase += max(in.compAttempts, 1)
		in.compAttempts, in.compStarted, in.forwardRetry = 0, sql.NullTime{}, a == ResolveRetry
	} else {
		// storage.ResolveSaga's row.
		in.state, in.step, in.version, in.awaiting = StateCompensating, next, in.version+1, false
		in.deadline = sql.NullTime{Time: now, Valid: true}
		in.compAttempts, in.compStarted, in.resumeStep = 0, sql.NullTime{}, resume
	}
	s.updatedAt = now
	s.hist = append(s.hist, storage.SagaStep{Step: r.Info.Step, Kind: KindResolved, Detail: detail, Attempt: r.Info.CompensationAttempts})
	s.at = append(s.at, now)
	return r, nil
}

// decide is Orchestrator.decideGuarded: the decision without the history
// first, with it when it asks.
func (e *simEngine[D]) decide(s *simSaga, inp input, now time.Time) (*transition, error) {
	var t *transition
	err := e.guard.Do("deciding on a saga instance", nil, func() error {
		var err error
		t, err = e.d.decide(s.in, inp, history{}, now)
		if errors.Is(err, errNeedHistory) {
			t, err = e.d.decide(s.in, inp, s.history(inp), now)
		}
		return err
	})
	return t, err
}

// history is loadHistory's answer, from memory.
func (s *simSaga) history(inp input) history {
	f := storage.SagaFactsQuery{ID: s.in.id, FinalKind: KindCompensated, AttemptKind: KindCompensation}
	if !inp.deadline {
		f.AnsweredStep, f.AnsweredKinds, f.AnsweredAttempt = inp.reply.step, answeredKinds(inp.reply), inp.reply.attempt
	}
	facts := storage.SagaFactsOf(s.hist, f)
	return history{loaded: true, answered: facts.Answered, compensated: facts.Final, compAttempts: facts.MaxAttempt}
}

// write stores transition t of s at now: the row (as the database would
// return it; a new saga's as InsertSaga writes it), the history and the
// commands; a transition whose version is 0 only its history.
func (e *simEngine[D]) write(s *simSaga, t *transition, now time.Time) {
	switch {
	case s.in.version == 0: // Start: inserted
		s.in = fromRow(storage.InsertedSaga(t.in.row()))
		s.updatedAt = now
	case t.in.version != 0:
		v := s.in.version + 1
		s.in = fromRow(t.in.row())
		s.in.version = v
		s.updatedAt = now
	}
	for _, r := range steps(t.hist) {
		s.hist = append(s.hist, r)
		s.at = append(s.at, now)
		if r.Kind == KindWait {
			st := e.d.def.steps[e.d.def.index[r.Step]]
			e.waits = append(e.waits, sagasim.Wait{SagaID: s.in.id, Step: r.Step, Event: st.WaitFor, Reject: st.FailureReply, At: now})
		}
	}
	for _, ev := range t.events {
		md := make(map[string]string, len(ev.Metadata))
		for k, v := range ev.Metadata {
			md[k] = v
		}
		att, _ := strconv.Atoi(md[metadata.SagaAttempt])
		e.cmds = append(e.cmds, sagasim.Command{SagaID: md[metadata.SagaID], Step: md[metadata.SagaStep], Phase: md[metadata.SagaPhase],
			Attempt: att, Topic: ev.Topic, Type: ev.EventType, Payload: append([]byte(nil), ev.Payload...), Metadata: md, At: now})
	}
}

// checkData is storage.SagaTransition's check of the data t writes.
func checkData(t *transition) error {
	if t.in.version == 0 {
		return nil
	}
	return storage.CheckJSONB(t.in.data)
}

// simRefusal is Orchestrator.refusal's text for data jsonb refuses.
func simRefusal(id string, err error) string {
	return "its new data cannot be stored; fix the step's OnSuccess (or the reply it copied), then `millwright saga resolve " + id + "`: " + err.Error()
}

func (e *simEngine[D]) Info(id string) (any, bool) {
	s, ok := e.sagas[id]
	if !ok {
		return Info{}, false
	}
	return s.info(), true
}

// info is infoOf(storage.GetSaga's row) from memory.
func (s *simSaga) info() Info {
	in := s.in
	out := Info{ID: in.id, Type: in.typ, State: in.state, StepIndex: in.step, Data: append([]byte(nil), in.data...),
		Version: in.version, AwaitingReply: in.awaiting, CompensationAttempts: in.compAttempts, Cause: in.cause.String,
		LastError: in.lastError.String, CreatedAt: in.createdAt, UpdatedAt: s.updatedAt, Branches: in.branches,
		DefinitionVersion: in.defVersion}
	if in.deadline.Valid {
		out.Deadline = in.deadline.Time
	}
	// As storage.GetSaga: the step of the newest command, compensation or
	// resolution; none once completed or with no step left.
	for i := len(s.hist) - 1; i >= 0; i-- {
		if k := s.hist[i].Kind; k == KindCommand || k == KindCompensation || k == KindResolved || k == KindWait || k == KindTimer {
			out.Step = s.hist[i].Step
			break
		}
	}
	if in.state == StateCompleted || in.step < 0 {
		out.Step = ""
	}
	return out
}

func (e *simEngine[D]) IDs() []string { return append([]string(nil), e.ids...) }

func (e *simEngine[D]) History(id string) []sagasim.Row {
	s, ok := e.sagas[id]
	if !ok {
		return nil
	}
	out := make([]sagasim.Row, len(s.hist))
	for i, r := range s.hist {
		out[i] = sagasim.Row{Step: r.Step, Kind: r.Kind, Detail: r.Detail, Attempt: r.Attempt, Error: r.Error, At: s.at[i]}
	}
	return out
}

func (e *simEngine[D]) Commands() []sagasim.Command { return e.cmds }
