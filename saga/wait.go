package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// Steps that send no command (waiting steps, timers) and steps that are
// retried instead of compensated (Retriable). They need no table of their
// own: a waiting step or a timer is a running instance at that step whose
// deadline_at is the wait's timeout or the timer's time, so both survive a
// restart like any step timeout; a Retriable step counts its attempts in
// the round columns the compensations use (compAttempts, compStarted,
// attemptBase), with forwardRetry set.
//
// How a running instance's deadline reads (onWaitDeadline):
//   - a timer step: the time has come, the step succeeded;
//   - a Retriable step awaiting a reply: the attempt timed out;
//   - a Retriable step not awaiting a reply (forwardRetry): its backoff
//     passed, or an operator resolved it with retry: send the next attempt;
//   - not awaiting a reply and not forwardRetry: an operator resolved the
//     stuck step with skip, it counts as done: go on with the next step.

// History kinds of waiting and timer steps, the kind column of
// millwright_saga_steps.
const (
	// KindWait: a waiting step began; detail is the event type it waits
	// for. Its event is then recorded as a KindReply (or a KindLateReply
	// after its timeout).
	KindWait = "wait"
	// KindTimer: a timer step began; detail is when it fires (RFC 3339).
	KindTimer = "timer"
	// KindTimerFired: a timer step's time came.
	KindTimerFired = "timer_fired"
)

// ErrNotWaiting is returned (wrapped) by Signal when the saga is not
// waiting for the event now: it has not reached the waiting step yet, its
// wait timed out, or the event was delivered before. Nothing is written;
// the message says where the saga is.
var ErrNotWaiting = errors.New("saga: instance is not waiting for that event")

func (s Step[D]) isWait() bool  { return s.WaitFor != "" }
func (s Step[D]) isTimer() bool { return s.Sleep != 0 || s.Until != nil }

// commandless reports whether the step sends no command (a waiting step or
// a timer).
func (s Step[D]) commandless() bool { return s.isWait() || s.isTimer() }

// waitDefaults sets what a waiting, timer or Retriable step implies.
func (s Step[D]) waitDefaults() Step[D] {
	if s.isWait() && s.SuccessReply == "" {
		s.SuccessReply = s.WaitFor
	}
	if (s.commandless() || s.Retriable) && s.Compensation == nil {
		s.NoCompensation = true // checkWait refuses a Compensation
	}
	return s
}

// checkWait returns what is wrong with the waiting, timer and retry fields
// of s, the step as the user wrote it (before its defaults), a step of saga
// type name.
func (s Step[D]) checkWait(name string) []error {
	var errs []error
	bad := func(field, why string, args ...any) {
		errs = append(errs, fmt.Errorf("saga: %q step %q: %s: %s", name, s.Name, field, fmt.Sprintf(why, args...)))
	}
	switch {
	case s.isWait():
		if s.Command != nil {
			bad("WaitFor and Command are both set", "a waiting step sends no command: remove Command, or WaitFor to make it a command step")
		}
		if s.isTimer() {
			bad("WaitFor and Sleep/Until are both set", "a step waits for an event or for a time: make them two steps")
		}
		if s.SuccessReply != "" && s.SuccessReply != s.WaitFor {
			bad("SuccessReply", "%q differs from WaitFor %q: the awaited event is the step's success; leave SuccessReply empty", s.SuccessReply, s.WaitFor)
		}
	case s.isTimer():
		if s.Command != nil {
			bad("Sleep/Until and Command are both set", "a timer step sends no command: remove Command, or make the timer a step of its own")
		}
		if s.Sleep != 0 && s.Until != nil {
			bad("Sleep and Until are both set", "set one: Sleep waits a duration from the step's start, Until until a time")
		}
		if s.Sleep < 0 || (s.Sleep > 0 && s.Sleep < time.Millisecond) {
			bad("Sleep", "%s: want at least 1ms", s.Sleep)
		}
		if s.SuccessReply != "" || s.FailureReply != "" || s.OnSuccess != nil {
			bad("SuccessReply, FailureReply or OnSuccess is set", "a timer step takes no reply: its time passing is its success; remove them")
		}
		if s.Timeout != 0 {
			bad("Timeout", "a timer step's time is its Sleep or Until: remove Timeout")
		}
	}
	kind := "waiting"
	if s.isTimer() && !s.isWait() {
		kind = "timer"
	}
	if s.commandless() {
		if s.Compensation != nil {
			bad("Compensation", "a %s step has nothing to undo: remove it (NoCompensation is implied)", kind)
		}
		if s.Retriable {
			bad("Retriable", "a %s step sends no command to retry: remove Retriable", kind)
		}
		if s.CompensationTimeout != 0 || s.CompensatedReply != "" || s.CompensationFailedReply != "" || s.Retry != (retry.Policy{}) {
			bad("CompensationTimeout, CompensatedReply, CompensationFailedReply or Retry is set", "a %s step is never compensated nor retried: remove them", kind)
		}
	} else if s.Retriable {
		if s.Compensation != nil {
			bad("Compensation", "a Retriable step is retried until it succeeds, never undone: remove Compensation (NoCompensation is implied), or Retriable to have its failure compensate the saga")
		}
		if s.CompensationTimeout != 0 || s.CompensatedReply != "" || s.CompensationFailedReply != "" {
			bad("CompensationTimeout, CompensatedReply or CompensationFailedReply is set", "a Retriable step is never compensated: remove them")
		}
	}
	return errs
}

// checkWaitSteps checks the rules between steps: after the first
// Retriable step (the pivot) only Retriable steps or timers may follow,
// since the saga can no longer compensate; and an event type names one
// waiting step.
func checkWaitSteps[D any](name string, steps []Step[D]) []error {
	var errs []error
	pivot := ""
	waits := map[string]string{}
	for _, s := range steps {
		switch {
		case s.Retriable:
			if pivot == "" {
				pivot = s.Name
			}
		case pivot != "" && !(s.isTimer() && !s.isWait()):
			errs = append(errs, fmt.Errorf("saga: %q step %q follows Retriable step %q: after the first Retriable step (the pivot) only Retriable steps or timers may follow, "+
				"as the saga can no longer compensate: make %q Retriable, or move it before %q", name, s.Name, pivot, s.Name, pivot))
		}
		if s.isWait() {
			if other, dup := waits[s.WaitFor]; dup {
				errs = append(errs, fmt.Errorf("saga: %q step %q: WaitFor %q is also step %q's: an event type names one waiting step; use distinct event types", name, s.Name, s.WaitFor, other))
			}
			waits[s.WaitFor] = s.Name
		}
	}
	return errs
}

// mermaidWait draws step i (Mermaid id sid, next the state after it) if it
// is a waiting, timer or Retriable step, and reports whether it did;
// stuck is set when the step can end stuck.
func (d *Definition[D]) mermaidWait(b *strings.Builder, i int, sid, next string, compTarget func(int) string, stuck *bool) bool {
	s := d.steps[i]
	switch {
	case s.isWait():
		fmt.Fprintf(b, "    %s --> %s: event %s\n", sid, next, s.WaitFor)
		fmt.Fprintf(b, "    %s --> %s: event %s\n", sid, compTarget(i-1), s.FailureReply)
		fmt.Fprintf(b, "    %s --> %s: no event in %s\n", sid, compTarget(i-1), s.Timeout)
		fmt.Fprintf(b, "    note right of %s: waits for %s\n", sid, s.WaitFor)
	case s.isTimer():
		when := "after " + s.Sleep.String()
		if s.Until != nil {
			when = "at Until(data)"
		}
		fmt.Fprintf(b, "    %s --> %s: timer, %s\n", sid, next, when)
	case s.Retriable:
		fmt.Fprintf(b, "    %s --> %s: %s\n", sid, next, s.SuccessReply)
		fmt.Fprintf(b, "    %s --> %s: %s or timeout %s (retry)\n", sid, sid, s.FailureReply, s.Timeout)
		fmt.Fprintf(b, "    %s --> Stuck: retries exhausted\n", sid)
		*stuck = true
	default:
		return false
	}
	return true
}

// enterStep makes step i current if it sends no command the usual way (a
// waiting step, a timer, a Retriable step) and reports whether it did. An
// error is a Retriable first step's command that cannot be built at Start.
func (d decider[D]) enterStep(t *transition, i int, data D, now time.Time) (bool, error) {
	s := d.def.steps[i]
	t.in.forwardRetry = false
	if !s.commandless() && !s.Retriable {
		return false, nil
	}
	t.in.state, t.in.step, t.in.awaiting = StateRunning, i, true
	// A step after a Retriable one starts with the round cleared.
	t.in.compAttempts, t.in.compStarted, t.in.attemptBase = 0, sql.NullTime{}, 0
	switch {
	case s.isWait():
		t.in.deadline = sql.NullTime{Time: now.Add(s.Timeout), Valid: true}
		t.record(s.Name, KindWait, s.WaitFor, 1, "")
	case s.isTimer():
		at := now.Add(s.Sleep)
		if s.Until != nil {
			at = s.Until(data)
		}
		t.in.deadline = sql.NullTime{Time: at, Valid: true}
		t.record(s.Name, KindTimer, at.UTC().Format(time.RFC3339Nano), 1, "")
	default:
		t.in.forwardRetry = true
		return true, d.sendAttempt(t, data, now)
	}
	return true, nil
}

// fwdAttempt is the wire attempt of a Retriable step's current command. A
// saga whose first step is Retriable was inserted without its round (the
// first attempt, sent at Start): compAttempts 0 is that attempt.
func (in instance) fwdAttempt() int { return in.attemptBase + max(in.compAttempts, 1) }

// sendAttempt sends the next attempt of the current (Retriable) step's
// command. A command that cannot be built is a failed attempt, except at
// Start (t.in.version 0), where the caller hears the error.
func (d decider[D]) sendAttempt(t *transition, data D, now time.Time) error {
	s := d.def.steps[t.in.step]
	t.in.compAttempts++
	if !t.in.compStarted.Valid {
		t.in.compStarted = sql.NullTime{Time: now, Valid: true}
	}
	attempt := t.in.attempt()
	cmd, err := s.Command(data)
	if err != nil {
		err = fmt.Errorf("step %q: building command: %w", s.Name, err)
	} else {
		var ev outbox.Event
		if ev, err = d.event(t.in.id, s.Name, PhaseForward, attempt, cmd); err != nil {
			err = fmt.Errorf("step %q: %w", s.Name, err)
		} else {
			t.events = append(t.events, ev)
			t.record(s.Name, KindCommand, cmd.Type, attempt, "")
			t.in.awaiting = true
			t.in.deadline = sql.NullTime{Time: now.Add(s.Timeout), Valid: true}
			return nil
		}
	}
	if t.in.version == 0 {
		return err
	}
	msg := fmt.Sprintf("%v (attempt %d)", err, attempt)
	t.record(s.Name, KindCommand, "", attempt, msg)
	d.attemptFailed(t, msg, now)
	return nil
}

// attemptFailed schedules the next attempt of the current Retriable
// step's command after its backoff, or makes the saga stuck when Retry is
// spent. It never compensates.
func (d decider[D]) attemptFailed(t *transition, reason string, now time.Time) {
	s := d.def.steps[t.in.step]
	t.in.compAttempts = max(t.in.compAttempts, 1)
	if !t.in.compStarted.Valid {
		t.in.compStarted = sql.NullTime{Time: t.in.createdAt, Valid: true} // sent at Start
	}
	t.in.forwardRetry = true
	t.in.lastError = sql.NullString{String: reason, Valid: true}
	if s.Retry.Exhausted(t.in.compAttempts, now.Sub(t.in.compStarted.Time)) {
		t.in.state, t.in.deadline, t.in.awaiting = StateStuck, sql.NullTime{}, false
		t.record(s.Name, KindStuck, "", t.in.attempt(), reason)
		t.note(note{what: noteStuck, step: s.Name, attempt: t.in.compAttempts, phase: PhaseForward})
		return
	}
	t.in.awaiting = false
	t.in.deadline = sql.NullTime{Time: now.Add(s.Retry.Delay(t.in.compAttempts, 0)), Valid: true}
}

// waitDeadline reports whether the passed deadline of running instance in
// is onWaitDeadline's.
func (d decider[D]) waitDeadline(in instance) bool {
	s := d.def.steps[in.step]
	return s.isTimer() || s.Retriable || !in.awaiting
}

// onWaitDeadline is the passed deadline of a running instance at a timer
// or Retriable step, or at a step an operator skipped.
func (d decider[D]) onWaitDeadline(t *transition, data D, h history, now time.Time) error {
	in := t.in
	s := d.def.steps[in.step]
	switch {
	case !in.awaiting && !in.forwardRetry:
		// Resolve skip: the step was done by hand (recorded by Resolve).
		return d.advance(t, in.step, data, h, now)
	case s.isTimer():
		t.record(s.Name, KindTimerFired, "", 1, "")
		return d.advance(t, in.step, data, h, now)
	case !in.awaiting:
		// The backoff passed, or an operator resolved with retry.
		return d.sendAttempt(t, data, now)
	default:
		msg := fmt.Sprintf("step %q (attempt %d) timed out after %s", s.Name, in.fwdAttempt(), s.Timeout)
		t.record(s.Name, KindTimeout, "", in.fwdAttempt(), msg)
		t.note(note{what: noteTimeout, step: s.Name})
		d.attemptFailed(t, msg, now)
		return nil
	}
}

// advance goes on after step i succeeded without a reply (a timer, a
// skipped step): the next step, or the saga completed. As onSuccess does.
func (d decider[D]) advance(t *transition, i int, data D, h history, now time.Time) error {
	s := d.def.steps[i]
	if i+1 == len(d.def.steps) {
		t.in.state, t.in.deadline, t.in.forwardRetry = StateCompleted, sql.NullTime{}, false
		t.record(s.Name, KindCompleted, "", 0, "")
		t.note(note{what: noteCompleted, step: s.Name})
		return nil
	}
	if err := d.sendCommand(t, i+1, data, now); err != nil {
		msg := err.Error()
		t.record(d.def.steps[i+1].Name, KindCommand, "", 1, msg)
		t.in.fail(msg)
		return d.compensateFrom(t, i, data, h, now)
	}
	return nil
}

// onRetriableReply handles a forward reply to a Retriable step (ok), else
// leaves r to onReply. A success of any attempt is the step's, also while
// it waits out a backoff or is stuck on it; a failure counts only for the
// attempt awaited: an earlier attempt's is recorded and ignored.
func (d decider[D]) onRetriableReply(in instance, r replyInfo, h history, now time.Time) (*transition, bool, error) {
	s := d.def.steps[r.stepIdx]
	if !s.Retriable || r.phase != PhaseForward || in.step != r.stepIdx {
		return nil, false, nil
	}
	switch {
	case r.reply.Type == s.SuccessReply && (in.state == StateRunning || (in.state == StateStuck && in.forwardRetry)):
		t := &transition{in: in}
		data, err := d.decode(in)
		if err != nil {
			return nil, true, err
		}
		t.in.lastError = sql.NullString{} // the failed attempts' reason; a Retriable step's saga never compensated
		if err := d.onSuccess(t, r, data, h, now); err != nil {
			return nil, true, err
		}
		if t.in.state == StateCompleted {
			t.in.forwardRetry = false
		}
		return t, true, nil
	case r.reply.Type == s.FailureReply && in.state == StateRunning && in.awaiting && r.attempt == in.fwdAttempt():
		t := &transition{in: in}
		e := replyError(r.reply)
		t.record(s.Name, KindReply, r.reply.Type, r.attempt, e)
		d.attemptFailed(t, fmt.Sprintf("step %q failed (attempt %d): %s", s.Name, r.attempt, e), now)
		return t, true, nil
	}
	t, err := d.onStaleReply(in, r, h, now)
	return t, true, err
}

// timerReplyError refuses a reply naming a timer step.
func (d decider[D]) timerReplyError(r replyInfo) error {
	return fmt.Errorf("saga %s %q: reply names step %q, a timer step: it takes no replies (its time passing is its success)", d.def.name, r.sagaID, r.step)
}

// signalReply is event eventType of saga sagaID as the reply of the
// waiting step it is for.
func (d decider[D]) signalReply(sagaID, eventType string, payload any) (replyInfo, error) {
	var waits []string
	idx := -1
	for i, s := range d.def.steps {
		if !s.isWait() {
			continue
		}
		waits = append(waits, fmt.Sprintf("%q (step %q; %q rejects it)", s.WaitFor, s.Name, s.FailureReply))
		if idx < 0 && (s.WaitFor == eventType || s.FailureReply == eventType) {
			idx = i
		}
	}
	if idx < 0 {
		if len(waits) == 0 {
			return replyInfo{}, fmt.Errorf("saga %s: event %q for %q: the saga has no waiting step (Step.WaitFor)", d.def.name, eventType, sagaID)
		}
		return replyInfo{}, fmt.Errorf("saga %s: event %q for %q: no step waits for it; the saga waits for %s", d.def.name, eventType, sagaID, strings.Join(waits, ", "))
	}
	if sagaID == "" {
		return replyInfo{}, fmt.Errorf("saga %s: event %q: empty saga id: pass the id the saga was started with", d.def.name, eventType)
	}
	body, err := marshalPayload(payload)
	if err != nil {
		return replyInfo{}, fmt.Errorf("saga %s %q: event %q: %w", d.def.name, sagaID, eventType, err)
	}
	s := d.def.steps[idx]
	md := map[string]string{metadata.SagaID: sagaID, metadata.SagaType: d.def.name, metadata.SagaStep: s.Name,
		metadata.SagaPhase: PhaseForward, metadata.SagaAttempt: "1", metadata.SagaReplyType: eventType}
	return replyInfo{sagaID: sagaID, step: s.Name, phase: PhaseForward, attempt: 1, stepIdx: idx,
		reply: Reply{Type: eventType, Payload: body, Metadata: md}}, nil
}

// waiting returns nil if instance in waits for r (signalReply's) now,
// else an error wrapping ErrNotWaiting that says where the saga is.
func (d decider[D]) waiting(in instance, r replyInfo) error {
	if in.state == StateRunning && in.step == r.stepIdx && in.awaiting {
		return nil
	}
	where := string(in.state)
	if in.state == StateRunning && in.step >= 0 && in.step < len(d.def.steps) {
		s := d.def.steps[in.step]
		switch {
		case s.isWait():
			where = fmt.Sprintf("waiting for %q at step %q", s.WaitFor, s.Name)
		case s.isTimer():
			where = fmt.Sprintf("at timer step %q", s.Name)
		default:
			where = fmt.Sprintf("at step %q, before step %q", s.Name, r.step)
			if in.step > r.stepIdx {
				where = fmt.Sprintf("at step %q, past step %q", s.Name, r.step)
			}
		}
		if in.deadline.Valid {
			where += " until " + in.deadline.Time.UTC().Format(time.RFC3339)
		}
	} else if in.state == StateCompensating || in.state == StateCompensated {
		where += fmt.Sprintf(" (%s)", in.cause.String)
	}
	return fmt.Errorf("saga %s %q: event %q is for step %q, but the saga is %s: %w", d.def.name, in.id, r.reply.Type, r.step, where, ErrNotWaiting)
}

// Signal delivers event eventType with payload (marshalled with
// encoding/json; []byte as is) to saga sagaID, waiting for it at one of its
// steps (Step.WaitFor, or that step's FailureReply to reject it), in tx,
// the caller's transaction: the event is applied, and the next step's
// command written to the outbox, if and only if tx commits. It locks the
// instance until then, as HandleReply does.
//
// It returns an error wrapping ErrNotFound when there is no such saga,
// ErrNotWaiting when the saga does not wait for the event now (saying
// where it is: not yet at the step, its wait timed out, the event was
// delivered before), and an error naming the saga's awaited events when
// no step waits for eventType; nothing is written then, and tx stays
// usable. Through the transport instead, send SignalEvent's event: there
// an event the saga does not wait for is recorded in its history
// (late_reply or duplicate) and ignored.
func (o *Orchestrator[D]) Signal(ctx context.Context, tx postgres.Tx, sagaID, eventType string, payload any) error {
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("saga %s: Signal(%q, %q): %w", o.def.name, sagaID, eventType, err)
	}
	r, err := o.d.signalReply(sagaID, eventType, payload)
	if err != nil {
		return err
	}
	row, err := storage.LockSaga(ctx, q, sagaID)
	if storage.IsNoRows(err) {
		return fmt.Errorf("saga %s: Signal(%q, %q): %w", o.def.name, sagaID, eventType, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("saga %s %q: loading instance%s: %w", o.def.name, sagaID, storage.Hint(err), err)
	}
	in := fromRow(row)
	if in.typ != o.def.name {
		return fmt.Errorf("saga %s: Signal(%q, %q): the instance is of saga type %q: signal it through that type's orchestrator", o.def.name, sagaID, eventType, in.typ)
	}
	if err := o.d.waiting(in, r); err != nil {
		return err
	}
	t, err := o.applyReply(ctx, q, r) // locked above: the row cannot move
	if err != nil {
		return err
	}
	o.report(t)
	return nil
}

// SignalEvent returns event eventType with payload for saga sagaID as an
// outbox event on the saga's reply topic, for HandleReply to apply: the way
// to deliver a waited-for event (Step.WaitFor) through the transport, from
// the transaction that learned of it (a webhook handler's):
//
//	ev, err := orders.SignalEvent(orderID, "payment.confirmed", body)
//	err = outbox.Add(ctx, tx, ev)
//
// An event arriving when the saga does not wait for it (its wait timed
// out, it was delivered before) is recorded in the saga's history and
// ignored. The error names the awaited events when no step waits for
// eventType.
func (o *Orchestrator[D]) SignalEvent(sagaID, eventType string, payload any) (outbox.Event, error) {
	r, err := o.d.signalReply(sagaID, eventType, payload)
	if err != nil {
		return outbox.Event{}, err
	}
	return outbox.Event{Topic: o.d.replyTopicFor(sagaID), AggregateType: "saga", AggregateID: sagaID, EventType: eventType,
		Payload: r.reply.Payload, Metadata: r.reply.Metadata, Source: o.cfg.Source}, nil
}

// resolveForward is Resolve of a saga stuck on a Retriable step's command
// (r.Info), in tx: retry sends the command again in a fresh round of
// attempts; skip takes the step as done by hand and goes on with the next
// step (or completes the saga).
func resolveForward(ctx context.Context, tx storage.Querier, r Resolution, note string) (Resolution, error) {
	in := r.Info
	if r.Action == ResolveRetry {
		r.Description = fmt.Sprintf("send the command of Retriable step %q (index %d) again with a fresh retry budget; it failed %d time(s), last: %s",
			in.Step, in.StepIndex, in.CompensationAttempts, in.LastError)
	} else {
		r.Description = fmt.Sprintf("mark Retriable step %q (index %d) as done by hand and go on with the next step (or complete the saga)",
			in.Step, in.StepIndex)
	}
	if r.DryRun {
		return r, nil
	}
	detail := string(r.Action)
	if note = strings.TrimSpace(note); note != "" {
		detail += ": " + note
	}
	if err := storage.ResolveSagaForward(ctx, tx, in.ID, r.Action == ResolveRetry,
		storage.SagaStep{Step: in.Step, Kind: KindResolved, Detail: detail, Attempt: in.CompensationAttempts}); err != nil {
		return r, fmt.Errorf("saga %q: resolving: %w", in.ID, err)
	}
	return r, nil
}
