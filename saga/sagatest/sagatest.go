package sagatest

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// PollInterval is how often WaitState reads the instance.
const PollInterval = 10 * time.Millisecond

// WaitState waits until saga id is in one of states and returns it. It
// returns an error naming the state it is in if ctx ends first (give ctx a
// deadline).
func WaitState(ctx context.Context, db postgres.Handle, id string, states ...saga.State) (saga.Info, error) {
	t := time.NewTicker(PollInterval)
	defer t.Stop()
	var last saga.Info
	var lastErr error
	for {
		info, _, err := saga.Get(ctx, db, id)
		if err == nil {
			last = info
			for _, s := range states {
				if info.State == s {
					return info, nil
				}
			}
		} else {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			if last.ID == "" {
				return last, fmt.Errorf("sagatest: saga %q never read (last error: %v): %w", id, lastErr, ctx.Err())
			}
			return last, fmt.Errorf("sagatest: saga %q is %s at step %q (last error %q), want %v: %w",
				id, last.State, last.Step, last.LastError, states, ctx.Err())
		case <-t.C:
		}
	}
}

// Command is a saga command as a Participant received it, or as a
// Simulator sent it.
type Command struct {
	SagaID  string
	Step    string
	Phase   string // saga.PhaseForward or saga.PhaseCompensation
	Attempt int
	// Topic, Type and Payload are the saga.Command's (Topic as the
	// Participant's subscription names it).
	Topic   string
	Type    string
	Payload []byte
	// At is when the Simulator sent it (zero from a Participant).
	At      time.Time
	Message *message.Message
}

// String is "step/phase/attempt".
func (c Command) String() string { return c.Step + "/" + c.Phase + "/" + strconv.Itoa(c.Attempt) }

// Answer is what a Participant does with a command.
type Answer int

const (
	// Succeed replies with the success (or compensated) reply type.
	Succeed Answer = iota
	// Fail replies with the failure (or compensation_failed) reply type.
	Fail
	// Silent does not reply: the step or compensation times out.
	Silent
)

// Participant answers saga commands as scripted and records them. It is
// idempotent by event id, like a real participant behind the idempotency
// middleware. It is safe for concurrent use.
type Participant struct {
	pub message.Publisher

	mu     sync.Mutex
	script func(Command) Answer
	seen   map[string]bool
	log    map[string][]Command
}

// NewParticipant returns a participant that publishes its replies with
// pub and answers Succeed until Script says otherwise.
func NewParticipant(pub message.Publisher) *Participant {
	return &Participant{pub: pub, seen: map[string]bool{}, log: map[string][]Command{}}
}

// Script sets the function that picks each answer.
func (p *Participant) Script(f func(Command) Answer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.script = f
}

// Commands returns the commands received for saga id, in arrival order.
func (p *Participant) Commands(id string) []Command {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Command(nil), p.log[id]...)
}

// Trace returns Commands(id) as "step/phase/attempt" strings, for
// comparing with an expected sequence.
func (p *Participant) Trace(id string) []string {
	cmds := p.Commands(id)
	out := make([]string, len(cmds))
	for i, c := range cmds {
		out[i] = c.String()
	}
	return out
}

// Handle is the participant's handler: consume the command topics with it.
// A message that is not a saga command fails, for the dead-letter path.
func (p *Participant) Handle(msg *message.Message) error {
	if !saga.IsCommand(msg) {
		return fmt.Errorf("sagatest: message %s is not a saga command (no %q metadata)", msg.UUID, metadata.SagaID)
	}
	md := msg.Metadata
	attempt, _ := strconv.Atoi(md.Get(metadata.SagaAttempt))
	cp := msg.Copy()
	c := Command{SagaID: md.Get(metadata.SagaID), Step: md.Get(metadata.SagaStep), Phase: md.Get(metadata.SagaPhase), Attempt: attempt,
		Topic: message.SubscribeTopicFromCtx(msg.Context()), Type: md.Get(metadata.EventType), Payload: cp.Payload, Message: cp}
	p.mu.Lock()
	if key := md.Get(metadata.EventID); key != "" {
		if p.seen[key] {
			p.mu.Unlock()
			return nil
		}
		p.seen[key] = true
	}
	p.log[c.SagaID] = append(p.log[c.SagaID], c)
	answer := Succeed
	if p.script != nil {
		answer = p.script(c)
	}
	p.mu.Unlock()

	if answer == Silent {
		return nil
	}
	typ := c.Step + ".succeeded"
	switch {
	case c.Phase == saga.PhaseForward && answer == Fail:
		typ = c.Step + ".failed"
	case c.Phase == saga.PhaseCompensation && answer == Fail:
		typ = c.Step + ".compensation_failed"
	case c.Phase == saga.PhaseCompensation:
		typ = c.Step + ".compensated"
	}
	reply, err := saga.NewReply(msg, typ, nil)
	if err != nil {
		return err
	}
	if answer == Fail {
		reply.Metadata.Set(metadata.SagaError, "sagatest: scripted failure of "+c.String())
	}
	return p.pub.Publish(saga.ReplyTopic(msg), reply)
}
