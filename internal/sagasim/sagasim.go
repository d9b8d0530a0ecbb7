// Package sagasim lets saga/sagatest drive package saga's decider in
// memory without a public saga type for it: package saga sets New at init
// (saga/simulate.go), and sagatest's Simulator calls it. The engine holds
// the instances and their step history as the orchestrator's tables
// would, and applies every input through the same decisions the
// orchestrator makes; it has no clock of its own (every call takes now)
// and no goroutines.
package sagasim

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// New returns an engine for def, a *saga.Definition[D], with cfg, a
// saga.Config (its ReplyTopic, ReplyShards and Source shape the commands).
// Set by package saga.
var New func(def, cfg any) (Engine, error)

// Engine is one simulated orchestrator with its tables. It is not safe
// for concurrent use.
type Engine interface {
	// Start starts saga id with data (a D) at now, as Orchestrator.Start.
	Start(id string, data any, now time.Time) error
	// Reply applies r at now, as Orchestrator.HandleReply applies its
	// message, and returns r completed (its phase, attempt and type).
	Reply(r Reply, now time.Time) (Reply, error)
	// ReplyMessage applies reply message msg at now, as
	// Orchestrator.HandleReply, and returns what it says.
	ReplyMessage(msg *message.Message, now time.Time) (Reply, error)
	// Signal delivers event eventType for saga id at now: as
	// Orchestrator.Signal, or with transport as HandleReply applies
	// Orchestrator.SignalEvent's event.
	Signal(id, eventType string, payload any, transport bool, now time.Time) error
	// Waits returns the waiting steps begun, oldest first: the engine's own
	// slice, to read only.
	Waits() []Wait
	// Due returns the earliest deadline at or before limit (the saga
	// whose deadline it is, and when), ok false when none is due.
	Due(limit time.Time) (id string, at time.Time, ok bool)
	// Fire fires saga id's deadline at now, as Orchestrator.RunOnce.
	Fire(id string, now time.Time) error
	// Resolve is saga.Resolve (action a saga.ResolveAction) at now; it
	// returns a saga.Resolution.
	Resolve(id, action, note string, dryRun bool, now time.Time) (any, error)
	// Info returns saga id as saga.Get would (a saga.Info), ok false when
	// there is none.
	Info(id string) (any, bool)
	// IDs returns the sagas in the order they started.
	IDs() []string
	// History returns saga id's step history, oldest first.
	History(id string) []Row
	// Commands returns every command sent, oldest first: the engine's own
	// slice, to read only.
	Commands() []Command
	// Steps returns the definition's step names.
	Steps() []string
}

// Reply is a participant's reply. Phase "" takes the phase the reply type
// belongs to; Attempt 0 the attempt of the newest command of the step in
// that phase; Type "" the step's own reply type of Phase: its failure
// (or compensation failure) when Failed, else its success (or
// compensated).
type Reply struct {
	SagaID, Step, Phase string
	Attempt             int
	Type                string
	Failed              bool
	Payload             []byte
	// Error is the failure reason (metadata.SagaError).
	Error string
}

// Row is one row of a saga's step history.
type Row struct {
	Step, Kind, Detail string
	Attempt            int
	Error              string
	At                 time.Time
}

// Wait is a waiting step a saga began (Step.WaitFor).
type Wait struct {
	SagaID, Step string
	// Event is the awaited event type; Reject the step's FailureReply.
	Event, Reject string
	At            time.Time
}

// Command is a command the engine sent (an outbox event).
type Command struct {
	SagaID, Step, Phase string
	Attempt             int
	Topic, Type         string
	Payload             []byte
	Metadata            map[string]string
	At                  time.Time
}
