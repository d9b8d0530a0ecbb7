package sagatest

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/sagasim"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/saga"
)

// SimEpoch is where a Simulator's clock starts unless ClockAt says
// otherwise.
var SimEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// MaxSimActions bounds RunUntilIdle: the replies and deadlines it applies
// in one call before it gives up with an error (a compensation retried
// forever, say).
const MaxSimActions = 10000

// endOfTime is later than any deadline.
var endOfTime = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)

// SimOption configures a Simulator.
type SimOption func(*simConfig)

type simConfig struct {
	start time.Time
	cfg   saga.Config
}

// ClockAt starts the simulated clock at t (default SimEpoch).
func ClockAt(t time.Time) SimOption { return func(c *simConfig) { c.start = t } }

// WithConfig gives the simulated orchestrator cfg: its ReplyTopic,
// ReplyShards and Source shape the commands' metadata as they would in
// production; the other fields do not apply.
func WithConfig(cfg saga.Config) SimOption { return func(c *simConfig) { c.cfg = cfg } }

// Simulator runs sagas of one type in memory, with no database or broker:
// it takes the place of the orchestrator, its tables, the transport and
// the participants, and makes every decision with the orchestrator's own
// decider (the same transitions, history rows, commands and errors).
// The test plays the participants, replying by hand (Succeed, Fail,
// Compensated, Reply, ...) or by script (OnStep, OnCompensation, Script,
// then RunUntilIdle), and the clock (Advance): nothing happens between
// calls, there are no goroutines and no wall clock, so a test is exactly
// reproducible. It is not safe for concurrent use.
//
// What differs from production, on purpose: retry backoffs are taken
// without jitter (a compensation is retried after exactly its
// exponential delay; the orchestrator waits a random part of it); a
// deadline fires exactly when it is due (Run fires it up to
// Config.PollInterval later); the outbox's checks of a command (its size,
// CloudEvents fields) are not made; and there is one orchestrator, so no
// two transitions of a saga ever race.
type Simulator[D any] struct {
	e   sagasim.Engine
	now time.Time

	script  func(Command) Answer
	payload func(Command) any
	answers map[stepPhase]Answer
	// done marks, by index into e.Commands(), the commands answered (by
	// hand or by the script) or handed to the script; every command
	// before next is done.
	done map[int]bool
	next int
	// waits is how many of e.Waits() were handed to the script.
	waits int
}

type stepPhase struct{ step, phase string }

// NewSimulator returns a simulator of def's sagas. The error names what
// is wrong (a nil definition, an invalid Config).
func NewSimulator[D any](def *saga.Definition[D], opts ...SimOption) (*Simulator[D], error) {
	c := simConfig{start: SimEpoch}
	for _, o := range opts {
		o(&c)
	}
	if def == nil {
		return nil, errors.New("sagatest: NewSimulator: definition is nil: build one with saga.Define")
	}
	e, err := sagasim.New(def, c.cfg)
	if err != nil {
		return nil, fmt.Errorf("sagatest: NewSimulator: %w", err)
	}
	return &Simulator[D]{e: e, now: c.start, answers: map[stepPhase]Answer{}, done: map[int]bool{}}, nil
}

// Now returns the simulated clock.
func (s *Simulator[D]) Now() time.Time { return s.now }

// Start starts saga id with data at Now, as Orchestrator.Start: the first
// step's command is sent. It returns an error wrapping
// saga.ErrAlreadyStarted when id was started before.
func (s *Simulator[D]) Start(id string, data D) error {
	return s.e.Start(id, data, s.now)
}

// Commands returns every command sent, in order.
func (s *Simulator[D]) Commands() []Command {
	cmds := s.e.Commands()
	out := make([]Command, len(cmds))
	for i, c := range cmds {
		out[i] = command(i, c)
	}
	return out
}

// Sent returns the commands sent for saga id, in order.
func (s *Simulator[D]) Sent(id string) []Command {
	var out []Command
	for i, c := range s.e.Commands() {
		if c.SagaID == id {
			out = append(out, command(i, c))
		}
	}
	return out
}

// Trace returns Sent(id) as "step/phase/attempt" strings, as
// Participant.Trace does.
func (s *Simulator[D]) Trace(id string) []string {
	cmds := s.Sent(id)
	out := make([]string, len(cmds))
	for i, c := range cmds {
		out[i] = c.String()
	}
	return out
}

// command is sent command number i as a participant would receive it.
func command(i int, c sagasim.Command) Command {
	id := "sim-command-" + strconv.Itoa(i+1)
	msg := message.NewMessage(id, c.Payload)
	for k, v := range c.Metadata {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.EventID, id)
	msg.Metadata.Set(metadata.OrderingKey, "saga/"+c.SagaID)
	if c.Type != "" {
		msg.Metadata.Set(metadata.EventType, c.Type)
	}
	return Command{SagaID: c.SagaID, Step: c.Step, Phase: c.Phase, Attempt: c.Attempt, Topic: c.Topic, Type: c.Type,
		Payload: c.Payload, At: c.At, Message: msg}
}

// Succeed answers the newest command of saga id's step with the step's
// success reply (no payload: an OnSuccess that needs one wants Reply).
func (s *Simulator[D]) Succeed(id, step string) error {
	return s.reply(sagasim.Reply{SagaID: id, Step: step, Phase: saga.PhaseForward})
}

// Fail answers the newest command of saga id's step with the step's
// failure reply, reason its metadata.SagaError.
func (s *Simulator[D]) Fail(id, step, reason string) error {
	return s.reply(sagasim.Reply{SagaID: id, Step: step, Phase: saga.PhaseForward, Failed: true, Error: reason})
}

// Compensated answers the newest compensation command of saga id's step
// with the step's compensated reply.
func (s *Simulator[D]) Compensated(id, step string) error {
	return s.reply(sagasim.Reply{SagaID: id, Step: step, Phase: saga.PhaseCompensation})
}

// CompensationFailed answers the newest compensation command of saga id's
// step with the step's compensation-failed reply, reason its
// metadata.SagaError.
func (s *Simulator[D]) CompensationFailed(id, step, reason string) error {
	return s.reply(sagasim.Reply{SagaID: id, Step: step, Phase: saga.PhaseCompensation, Failed: true, Error: reason})
}

// Reply answers saga id's step with a reply of type replyType (one of the
// step's four reply types, which also says the phase) carrying payload,
// marshalled with encoding/json ([]byte as is, nil as {}), to the newest
// command of the step in that phase.
func (s *Simulator[D]) Reply(id, step, replyType string, payload any) error {
	body, err := marshal(payload)
	if err != nil {
		return fmt.Errorf("sagatest: reply %q to step %q of %q: %w", replyType, step, id, err)
	}
	return s.reply(sagasim.Reply{SagaID: id, Step: step, Type: replyType, Payload: body})
}

// ReplyTo answers command c (of Commands or Sent: its step, phase and
// attempt) with replyType and payload, as Reply: a second answer to it is
// a duplicate, an answer to an older attempt late.
func (s *Simulator[D]) ReplyTo(c Command, replyType string, payload any) error {
	body, err := marshal(payload)
	if err != nil {
		return fmt.Errorf("sagatest: reply %q to %s of %q: %w", replyType, c, c.SagaID, err)
	}
	return s.reply(sagasim.Reply{SagaID: c.SagaID, Step: c.Step, Phase: c.Phase, Attempt: c.Attempt, Type: replyType, Payload: body})
}

// HandleReply applies a reply message, as Orchestrator.HandleReply: one
// a participant's own handler made with saga.NewReply from a command's
// Message, say.
func (s *Simulator[D]) HandleReply(msg *message.Message) error {
	r, err := s.e.ReplyMessage(msg, s.now)
	if err != nil {
		return err
	}
	s.answered(r)
	return nil
}

// Signal delivers event eventType (payload marshalled with encoding/json,
// []byte as is) to saga id, waiting for it at a step with Step.WaitFor
// (or rejecting it, with that step's FailureReply), as
// Orchestrator.Signal: the error wraps saga.ErrNotWaiting, and nothing is
// recorded, when the saga does not wait for it now (its wait timed out,
// the event came before, the step is not reached yet), saga.ErrNotFound
// for an unknown saga, and names the awaited events when no step waits
// for eventType.
func (s *Simulator[D]) Signal(id, eventType string, payload any) error {
	return s.e.Signal(id, eventType, payload, false, s.now)
}

// SignalEvent delivers event eventType to saga id through the transport,
// as HandleReply applies Orchestrator.SignalEvent's event: an event the
// saga does not wait for now is recorded in its history (late_reply or
// duplicate) and ignored.
func (s *Simulator[D]) SignalEvent(id, eventType string, payload any) error {
	return s.e.Signal(id, eventType, payload, true, s.now)
}

func (s *Simulator[D]) reply(r sagasim.Reply) error {
	r, err := s.e.Reply(r, s.now)
	if err != nil {
		return err
	}
	s.answered(r)
	return nil
}

// answered marks the commands r answers as done: RunUntilIdle does not
// hand them to the script.
func (s *Simulator[D]) answered(r sagasim.Reply) {
	cmds := s.e.Commands()
	for i := s.next; i < len(cmds); i++ {
		if c := cmds[i]; c.SagaID == r.SagaID && c.Step == r.Step && c.Phase == r.Phase && c.Attempt == r.Attempt {
			s.done[i] = true
		}
	}
}

func marshal(p any) ([]byte, error) {
	switch v := p.(type) {
	case nil:
		return nil, nil
	case []byte:
		return v, nil
	case json.RawMessage:
		return v, nil
	}
	b, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("marshalling payload %T: %w", p, err)
	}
	return b, nil
}

// Advance moves the clock d forward, firing every deadline that falls due
// on the way, in order, each at its time, as Run would (a step's timeout,
// a compensation's timeout or retry backoff). It replies to nothing:
// commands sent meanwhile wait for a reply by hand or RunUntilIdle. An
// error (a Compensation builder's, say) stops the clock at that deadline,
// which stays due.
func (s *Simulator[D]) Advance(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("sagatest: Advance(%s): the clock only moves forward", d)
	}
	target := s.now.Add(d)
	for {
		id, at, ok := s.e.Due(target)
		if !ok {
			break
		}
		if at.After(s.now) {
			s.now = at
		}
		if err := s.e.Fire(id, s.now); err != nil {
			return err
		}
	}
	s.now = target
	return nil
}

// Script sets the function that picks the answer RunUntilIdle gives a
// command for which OnStep or OnCompensation set none. Default: Succeed.
func (s *Simulator[D]) Script(f func(Command) Answer) { s.script = f }

// ScriptPayload sets the function that gives the payload of each reply
// (and waited-for event) RunUntilIdle sends (marshalled as Reply's; nil:
// none, sent as {}): what a step's OnSuccess reads, a reservation id say.
func (s *Simulator[D]) ScriptPayload(f func(Command) any) { s.payload = f }

// OnStep sets the answer RunUntilIdle gives step's commands (Succeed,
// Fail or Silent: it times out). For a waiting step (Step.WaitFor),
// Succeed signals its event as soon as the saga waits, Fail the step's
// FailureReply event, Silent nothing (the wait times out). The error
// names an unknown step.
func (s *Simulator[D]) OnStep(step string, a Answer) error {
	return s.on(step, saga.PhaseForward, a)
}

// OnCompensation sets the answer RunUntilIdle gives step's compensation
// commands (Fail until the step's Retry budget is spent makes the saga
// stuck). The error names an unknown step.
func (s *Simulator[D]) OnCompensation(step string, a Answer) error {
	return s.on(step, saga.PhaseCompensation, a)
}

func (s *Simulator[D]) on(step, phase string, a Answer) error {
	if err := s.checkStep(step); err != nil {
		return err
	}
	if a != Succeed && a != Fail && a != Silent {
		return fmt.Errorf("sagatest: answer %d for step %q: want Succeed, Fail or Silent", a, step)
	}
	s.answers[stepPhase{step, phase}] = a
	return nil
}

func (s *Simulator[D]) checkStep(step string) error {
	steps := s.e.Steps()
	for _, n := range steps {
		if n == step {
			return nil
		}
	}
	return fmt.Errorf("sagatest: unknown step %q: want one of %q", step, steps)
}

// RunUntilIdle plays the participants and the clock until nothing is
// left to happen: it hands each command sent and not yet answered to the
// script, oldest first, and applies its answer at once (a participant
// answering without delay); then each wait begun (a waiting step, handed
// as a Command with its event as Type and no Topic nor Message; the
// answer is signalled); when none is left it moves the clock to the next
// deadline and fires it (as Advance: timers, timeouts, retries). It returns when no command
// is left and no saga has a deadline (every saga is completed,
// compensated or stuck, or waits for an answer Silent withheld and has no
// deadline), or with an error after MaxSimActions replies and deadlines
// (a compensation retried forever, say) or when a reply or deadline fails.
func (s *Simulator[D]) RunUntilIdle() error {
	for n := 0; ; n++ {
		if n == MaxSimActions {
			return fmt.Errorf("sagatest: RunUntilIdle: still busy after %d replies and deadlines (at %s): "+
				"does a compensation retry forever (Retry.MaxAttempts -1) while failing?", MaxSimActions, s.now.Format(time.RFC3339Nano))
		}
		cmds := s.e.Commands()
		for s.next < len(cmds) && s.done[s.next] {
			delete(s.done, s.next)
			s.next++
		}
		if s.next < len(cmds) {
			s.done[s.next] = true
			c := command(s.next, cmds[s.next])
			a := s.answer(c)
			if a == Silent {
				continue
			}
			r := sagasim.Reply{SagaID: c.SagaID, Step: c.Step, Phase: c.Phase, Attempt: c.Attempt, Failed: a == Fail}
			if a == Fail {
				r.Error = "sagatest: scripted failure of " + c.String()
			}
			if s.payload != nil {
				body, err := marshal(s.payload(c))
				if err != nil {
					return fmt.Errorf("sagatest: RunUntilIdle: the payload of the reply to %s of %q: %w", c, c.SagaID, err)
				}
				r.Payload = body
			}
			if err := s.reply(r); err != nil {
				return fmt.Errorf("sagatest: RunUntilIdle: answering %s of %q: %w", c, c.SagaID, err)
			}
			continue
		}
		if waits := s.e.Waits(); s.waits < len(waits) {
			w := waits[s.waits]
			s.waits++
			c := Command{SagaID: w.SagaID, Step: w.Step, Phase: saga.PhaseForward, Attempt: 1, Type: w.Event, At: w.At}
			event := w.Event
			switch s.answer(c) {
			case Silent:
				continue
			case Fail:
				event = w.Reject
			}
			var payload any
			if s.payload != nil {
				payload = s.payload(c)
			}
			// A wait already answered by hand is left alone.
			if err := s.Signal(w.SagaID, event, payload); err != nil && !errors.Is(err, saga.ErrNotWaiting) {
				return fmt.Errorf("sagatest: RunUntilIdle: answering the wait of step %q of %q: %w", w.Step, w.SagaID, err)
			}
			continue
		}
		id, at, ok := s.e.Due(endOfTime)
		if !ok {
			return nil
		}
		if at.After(s.now) {
			s.now = at
		}
		if err := s.e.Fire(id, s.now); err != nil {
			return fmt.Errorf("sagatest: RunUntilIdle: %w", err)
		}
	}
}

func (s *Simulator[D]) answer(c Command) Answer {
	if a, ok := s.answers[stepPhase{c.Step, c.Phase}]; ok {
		return a
	}
	if s.script != nil {
		return s.script(c)
	}
	return Succeed
}

// Resolve is saga.Resolve for a stuck simulated saga: with
// saga.ResolveRetry its compensation is sent again with a fresh budget,
// with saga.ResolveSkip the compensations before it follow, once the
// deadline due now fires (Advance(0) or RunUntilIdle). The error wraps
// saga.ErrNotFound or saga.ErrNotStuck when the saga cannot be resolved.
func (s *Simulator[D]) Resolve(id string, action saga.ResolveAction, note string) (saga.Resolution, error) {
	r, err := s.e.Resolve(id, string(action), note, false, s.now)
	res, _ := r.(saga.Resolution)
	return res, err
}

// Info returns saga id as saga.Get would; an unknown id is an error
// wrapping saga.ErrNotFound.
func (s *Simulator[D]) Info(id string) (saga.Info, error) {
	in, ok := s.e.Info(id)
	if !ok {
		return saga.Info{}, fmt.Errorf("sagatest: saga %q: %w (started: %q)", id, saga.ErrNotFound, s.e.IDs())
	}
	return in.(saga.Info), nil
}

// State returns saga id's state, "" for an unknown id.
func (s *Simulator[D]) State(id string) saga.State {
	in, _ := s.e.Info(id)
	return in.(saga.Info).State
}

// Data returns saga id's data, decoded as the orchestrator decodes it.
func (s *Simulator[D]) Data(id string) (D, error) {
	var d D
	in, err := s.Info(id)
	if err != nil {
		return d, err
	}
	if err := json.Unmarshal(in.Data, &d); err != nil {
		return d, fmt.Errorf("sagatest: saga %q: decoding data into %T: %w", id, d, err)
	}
	return d, nil
}

// History returns saga id's step history, oldest first, as saga.History
// would (nil for an unknown id).
func (s *Simulator[D]) History(id string) []saga.HistoryEntry {
	rows := s.e.History(id)
	if rows == nil {
		return nil
	}
	out := make([]saga.HistoryEntry, len(rows))
	for i, r := range rows {
		out[i] = saga.HistoryEntry{Step: r.Step, Kind: r.Kind, Detail: r.Detail, Attempt: r.Attempt, Error: r.Error, At: r.At}
	}
	return out
}
