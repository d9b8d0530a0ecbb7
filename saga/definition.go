package saga

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millwright/millwright/retry"
)

// Command is a message the orchestrator sends to a participant, through the
// outbox, in the transaction of the transition that causes it.
type Command struct {
	// Topic the command is published to. Required.
	Topic string
	// Type is the command's CloudEvents type, e.g. "inventory.reserve.v1".
	// Optional.
	Type string
	// Payload is marshalled with encoding/json; a []byte or json.RawMessage
	// is sent as is.
	Payload any
	// Metadata is copied to the message; the saga keys (metadata.SagaID,
	// ...) are added and win.
	Metadata map[string]string
}

// Reply is a participant's answer to a command, as the orchestrator received
// it.
type Reply struct {
	// Type is the reply type: metadata.SagaReplyType, else metadata.EventType.
	Type string
	// Payload is the message body.
	Payload []byte
	// Metadata of the message.
	Metadata map[string]string
}

// Decode unmarshals the reply's JSON payload into v.
func (r Reply) Decode(v any) error {
	if err := json.Unmarshal(r.Payload, v); err != nil {
		return fmt.Errorf("saga: decoding reply %q payload into %T: %w", r.Type, v, err)
	}
	return nil
}

// Step is one step of a saga whose data has type D.
type Step[D any] struct {
	// Name identifies the step in history, metadata and diagrams. Required,
	// unique within the saga; letters, digits, '_', '-' and '.'.
	Name string
	// Command builds the step's command from the saga data. Required. An
	// error is returned by Start for the first step; for a later step it
	// fails the saga there, and the steps done so far are compensated.
	Command func(data D) (Command, error)
	// SuccessReply and FailureReply are the reply types that mean the step
	// succeeded or failed. Default Name+".succeeded" and Name+".failed".
	SuccessReply string
	FailureReply string
	// OnSuccess, when set, updates the saga data from the success reply
	// (a reservation id, a payment id) before the next command is built.
	// An error fails the reply handling, which is retried by redelivery.
	OnSuccess func(data *D, reply Reply) error
	// Compensation builds the command that undoes the step. It is sent
	// when a later step fails, when this step times out (its effect is
	// unknown), and when this step's success arrives after its timeout (a
	// late success: the effect did happen, after the saga gave up). An
	// error counts as a failed compensation attempt (retried, then stuck).
	// Every step sets Compensation or NoCompensation: Define refuses a
	// step with neither.
	Compensation func(data D) (Command, error)
	// NoCompensation declares that the step has nothing to undo: its
	// effect is harmless to keep (a read, a notification). A failure or a
	// timeout skips it, and its late success is recorded and ignored, so
	// its effect stays. Set either this or Compensation, not both.
	NoCompensation bool
	// CompensatedReply and CompensationFailedReply are the reply types of
	// the compensation command. Default Name+".compensated" and
	// Name+".compensation_failed".
	CompensatedReply        string
	CompensationFailedReply string
	// Timeout is how long the orchestrator waits for a reply to the step's
	// command. Default 1 minute; minimum 1ms.
	Timeout time.Duration
	// CompensationTimeout is how long it waits for a reply to one
	// compensation attempt; an unanswered attempt counts as failed. Default
	// Timeout.
	CompensationTimeout time.Duration
	// Retry is the backoff between attempts of a failed (or unanswered)
	// compensation; when it is exhausted the saga becomes stuck. Default:
	// retry.Policy defaults (5 attempts, from 100ms, full jitter).
	// MaxAttempts -1 retries forever. For a Retriable step it is the
	// backoff between attempts of its command.
	Retry retry.Policy
	// Parallel, when set, makes the step a group of at least 2 branches
	// that run at once: every branch's command is sent when the group is
	// reached, each branch has its own Timeout and replies, and the group
	// succeeds when all branches succeeded. A group sets only Name and
	// Parallel; a branch is an ordinary step (not itself a group) whose
	// Name is unique within the saga. When a branch fails or times out, the
	// branches still running are awaited (or time out), then the branches
	// that succeeded or timed out are compensated, last declared first,
	// then the steps before the group. See "Parallel branches" in the
	// package doc.
	Parallel []Step[D]

	// WaitFor makes the step a waiting step: it sends no command (leave
	// Command nil) and waits, up to Timeout, for an event of this type
	// correlated to the saga (an approval, a webhook), delivered with
	// Orchestrator.Signal in the caller's transaction or through the
	// transport (Orchestrator.SignalEvent, consumed by HandleReply). The
	// event is the step's success (SuccessReply is WaitFor; OnSuccess may
	// copy its payload into the data); an event of type FailureReply
	// rejects the step. Its timeout compensates the earlier steps, and an
	// event after it is recorded and ignored. A wait has nothing to undo
	// (NoCompensation is implied). Unique among the saga's waiting steps.
	WaitFor string
	// Sleep and Until make the step a timer: it sends no command and
	// succeeds when Sleep has passed since it began, or at the time Until
	// returns for the data (a time already past goes on at the next
	// poll). Set one of them, and none of Command, WaitFor, the reply
	// fields, OnSuccess, Timeout or Compensation. NoCompensation is
	// implied. Sleep: minimum 1ms.
	Sleep time.Duration
	Until func(data D) time.Time
	// Retriable makes a failure reply or a timeout of the step's command
	// send it again (metadata.SagaAttempt + 1) after Retry's backoff
	// instead of compensating; once Retry is spent the saga is stuck for
	// an operator (`millwright saga resolve`: retry sends the command
	// again, skip takes the step as done by hand and goes on). Such a step
	// is never undone: it may not set Compensation (NoCompensation is
	// implied), and after the first Retriable step (the pivot: the saga
	// can no longer go back) only Retriable steps or timers may follow.
	// Its participant must be idempotent: the same command may arrive
	// more than once, and a success of any attempt is the step's.
	Retriable bool
}

// DefaultTimeout is Step.Timeout's default.
const DefaultTimeout = time.Minute

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// Definition is a saga type: a name and ordered steps. It is immutable once
// defined and safe for concurrent use.
type Definition[D any] struct {
	name  string
	steps []Step[D]
	index map[string]int
	// groups are the Parallel steps, whose branches are in steps.
	groups []group
}

// Define declares a saga type named name whose steps run in the given
// order. The name is stored with every instance (keep it stable across
// deploys) and also names the default reply topic (name + "_replies").
// The error names every invalid step and field; among them, a step that
// sets neither Compensation nor NoCompensation.
func Define[D any](name string, steps ...Step[D]) (*Definition[D], error) {
	var errs []error
	if !nameRE.MatchString(name) {
		errs = append(errs, fmt.Errorf("saga: Define: name %q: want letters, digits, '_', '-' or '.', not empty", name))
	}
	if len(steps) == 0 {
		errs = append(errs, fmt.Errorf("saga: Define(%q): no steps: pass at least one saga.Step", name))
	}
	d := &Definition[D]{name: name, index: make(map[string]int, len(steps))}
	for i, s := range steps {
		if s.Parallel != nil {
			errs = append(errs, d.addGroup(name, i, s)...)
			continue
		}
		if !nameRE.MatchString(s.Name) {
			errs = append(errs, fmt.Errorf("saga: %q step %d: Name %q: want letters, digits, '_', '-' or '.', not empty", name, i, s.Name))
		} else if _, dup := d.index[s.Name]; dup {
			errs = append(errs, fmt.Errorf("saga: %q step %d: Name %q is used by an earlier step: step names must be unique", name, i, s.Name))
		}
		d.index[s.Name] = len(d.steps)
		errs = append(errs, s.checkWait(name)...) // wait.go, on the step as given
		s = s.withDefaults()
		errs = append(errs, s.check(name)...)
		d.steps = append(d.steps, s)
	}
	errs = append(errs, d.checkGroupNames(name)...)
	errs = append(errs, checkWaitSteps(name, d.steps)...) // wait.go
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return d, nil
}

// withDefaults returns s with its unset reply types, timeouts and retry
// policy set to their defaults.
func (s Step[D]) withDefaults() Step[D] {
	s = s.waitDefaults() // wait.go
	if s.SuccessReply == "" {
		s.SuccessReply = s.Name + ".succeeded"
	}
	if s.FailureReply == "" {
		s.FailureReply = s.Name + ".failed"
	}
	if s.CompensatedReply == "" {
		s.CompensatedReply = s.Name + ".compensated"
	}
	if s.CompensationFailedReply == "" {
		s.CompensationFailedReply = s.Name + ".compensation_failed"
	}
	if s.Timeout == 0 {
		s.Timeout = DefaultTimeout
	}
	if s.CompensationTimeout == 0 {
		s.CompensationTimeout = s.Timeout
	}
	s.Retry = s.Retry.WithDefaults()
	return s
}

// check returns what is wrong with s (with its defaults), a step of saga
// type name.
func (s Step[D]) check(name string) []error {
	var errs []error
	if s.Command == nil && !s.commandless() { // wait.go
		errs = append(errs, fmt.Errorf("saga: %q step %q: Command is nil: set the function that builds the step's command", name, s.Name))
	}
	// A step without a compensation keeps whatever its command did,
	// even after the saga gave up on it: that must be a decision.
	switch {
	case s.Compensation == nil && !s.NoCompensation:
		errs = append(errs, fmt.Errorf("saga: %q step %q: no Compensation: set Compensation to the command that undoes the step, "+
			"or NoCompensation: true if its effect is harmless to keep (its success after a timeout is then kept too)", name, s.Name))
	case s.Compensation != nil && s.NoCompensation:
		errs = append(errs, fmt.Errorf("saga: %q step %q: both Compensation and NoCompensation are set: keep one", name, s.Name))
	}
	for _, r := range []string{s.SuccessReply, s.FailureReply, s.CompensatedReply, s.CompensationFailedReply} {
		if !utf8.ValidString(r) || strings.ContainsRune(r, 0) {
			// The history stores reply types as text.
			errs = append(errs, fmt.Errorf("saga: %q step %q: reply type %q is not valid UTF-8 or holds a NUL byte, which Postgres text cannot store", name, s.Name, r))
		}
	}
	if s.SuccessReply == s.FailureReply || s.CompensatedReply == s.CompensationFailedReply {
		errs = append(errs, fmt.Errorf("saga: %q step %q: success and failure reply types must differ", name, s.Name))
	}
	if s.Timeout < time.Millisecond || s.CompensationTimeout < time.Millisecond {
		errs = append(errs, fmt.Errorf("saga: %q step %q: Timeout %s, CompensationTimeout %s: want at least 1ms", name, s.Name, s.Timeout, s.CompensationTimeout))
	}
	if err := s.Retry.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("saga: %q step %q: Retry: %w", name, s.Name, err))
	}
	return errs
}

// MustDefine is Define for package-level definitions: it panics on an
// invalid definition, which is a programming error found at start-up.
func MustDefine[D any](name string, steps ...Step[D]) *Definition[D] {
	d, err := Define(name, steps...)
	if err != nil {
		panic(err)
	}
	return d
}

// Name returns the saga type's name.
func (d *Definition[D]) Name() string { return d.name }

// Steps returns the step names in order; a group's branches stand in for
// the group, in their declared order.
func (d *Definition[D]) Steps() []string {
	names := make([]string, len(d.steps))
	for i, s := range d.steps {
		names[i] = s.Name
	}
	return names
}

// Mermaid returns the saga type as a Mermaid state diagram: the forward
// path, where each failure or timeout leads, and the compensations in
// reverse order.
func (d *Definition[D]) Mermaid() string {
	if len(d.groups) > 0 {
		return d.mermaidWithGroups() // group.go
	}
	var b strings.Builder
	id := func(s string) string { return strings.NewReplacer(".", "_", "-", "_").Replace(s) }
	fmt.Fprintf(&b, "stateDiagram-v2\n")
	fmt.Fprintf(&b, "    %%%% saga %s\n", d.name)
	fmt.Fprintf(&b, "    [*] --> %s\n", id(d.steps[0].Name))
	stuck := false
	// compTarget(i) is the first compensation at or below step i, or the
	// end state when no step down from i has one.
	compTarget := func(i int) string {
		for j := i; j >= 0; j-- {
			if d.steps[j].Compensation != nil {
				return "undo_" + id(d.steps[j].Name)
			}
		}
		return "Compensated"
	}
	for i, s := range d.steps {
		next := "Completed"
		if i+1 < len(d.steps) {
			next = id(d.steps[i+1].Name)
		}
		if d.mermaidWait(&b, i, id(s.Name), next, compTarget, &stuck) { // wait.go
			continue
		}
		fmt.Fprintf(&b, "    %s --> %s: %s\n", id(s.Name), next, s.SuccessReply)
		fmt.Fprintf(&b, "    %s --> %s: %s\n", id(s.Name), compTarget(i-1), s.FailureReply)
		fmt.Fprintf(&b, "    %s --> %s: timeout %s\n", id(s.Name), compTarget(i), s.Timeout)
	}
	for i := len(d.steps) - 1; i >= 0; i-- {
		s := d.steps[i]
		if s.Compensation == nil {
			continue
		}
		stuck = true
		u := "undo_" + id(s.Name)
		fmt.Fprintf(&b, "    %s --> %s: %s\n", u, compTarget(i-1), s.CompensatedReply)
		fmt.Fprintf(&b, "    %s --> %s: %s (retry)\n", u, u, s.CompensationFailedReply)
		fmt.Fprintf(&b, "    %s --> Stuck: retries exhausted\n", u)
	}
	// A step's success after its timeout sends its compensation wherever
	// the saga is (drawn from the end state only, to keep the diagram
	// readable); the interrupted chain resumes afterwards.
	for i := len(d.steps) - 1; i >= 0; i-- {
		if s := d.steps[i]; s.Compensation != nil {
			fmt.Fprintf(&b, "    Compensated --> undo_%s: %s late\n", id(s.Name), s.SuccessReply)
		}
	}
	if stuck {
		// Resolve sends the stuck compensation again (retry) or goes on
		// with the next one (skip).
		fmt.Fprintf(&b, "    note right of Stuck: millwright saga resolve ID (retry or skip)\n")
	}
	fmt.Fprintf(&b, "    Completed --> [*]\n")
	fmt.Fprintf(&b, "    Compensated --> [*]\n")
	return b.String()
}
