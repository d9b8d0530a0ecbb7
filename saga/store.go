package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// The orchestrator's I/O: load what a decision needs, then write the
// transition, through the storage layer's saga operations
// (internal/storage/saga.go), in the transaction that locked the instance.

func fromRow(r storage.SagaInstance) instance {
	return instance{id: r.ID, typ: r.Type, state: State(r.State), step: r.Step, data: r.Data, version: r.Version,
		deadline: r.Deadline, awaiting: r.Awaiting, compAttempts: r.CompAttempts, compStarted: r.CompStarted,
		lastError: r.LastError, createdAt: r.CreatedAt, attemptBase: r.AttemptBase, resumeStep: r.ResumeStep, cause: r.Cause,
		branches: branchesOf(r.Branches), forwardRetry: r.ForwardRetry}
}

// row is in as stored. Its texts (last_error, cause) are made storable:
// they quote the definition's own errors (a Command that failed), which
// may hold bytes Postgres text refuses, and that would fail the write of
// the transition on every attempt (the round of every saga of the type).
func (in instance) row() storage.SagaInstance {
	return storage.SagaInstance{ID: in.id, Type: in.typ, State: string(in.state), Step: in.step, Data: in.data, Version: in.version,
		Deadline: in.deadline, Awaiting: in.awaiting, CompAttempts: in.compAttempts, CompStarted: in.compStarted,
		LastError: storableNull(in.lastError), CreatedAt: in.createdAt, AttemptBase: in.attemptBase, ResumeStep: in.resumeStep,
		Cause: storableNull(in.cause), Branches: marshalBranches(in.branches), ForwardRetry: in.forwardRetry}
}

func storableNull(s sql.NullString) sql.NullString {
	s.String = storableText(s.String)
	return s
}

// steps is h as stored, its texts made storable (see row).
func steps(h []histRow) []storage.SagaStep {
	out := make([]storage.SagaStep, len(h))
	for i, r := range h {
		out[i] = storage.SagaStep{Step: r.step, Kind: r.kind, Detail: storableText(r.detail), Attempt: r.attempt, Error: storableText(r.err)}
	}
	return out
}

// decideIn decides what inp does to in, reading the saga's history only
// when the decision needs it (a stale reply, a compensation to start):
// most transitions read nothing more than the locked row. A decision asks
// for the history before it calls any of the definition's functions,
// except after a success whose next command cannot be built: that step's
// OnSuccess and the next Command then run twice, on the same data.
func (o *Orchestrator[D]) decideIn(ctx context.Context, q storage.Querier, in instance, inp input, now time.Time) (*transition, error) {
	t, err := o.d.decide(in, inp, history{}, now)
	if !errors.Is(err, errNeedHistory) {
		return t, err
	}
	h, err := loadHistory(ctx, q, in.id, inp)
	if err != nil {
		return nil, &loadError{fmt.Errorf("saga %s %q: reading history: %w", o.def.name, in.id, err)}
	}
	return o.d.decide(in, inp, h, now)
}

// loadError is a decision's failure to read the history: the round or the
// reply fails (and is retried), unlike a decision that cannot be made.
type loadError struct{ err error }

func (e *loadError) Error() string { return e.err.Error() }
func (e *loadError) Unwrap() error { return e.err }

// decideGuarded is decideIn with a panic of the definition's code
// recovered (logged with the instance and fields, counted in
// MetricLoopPanics) and returned as an error. A failure to read the
// history is a *loadError.
func (o *Orchestrator[D]) decideGuarded(ctx context.Context, q storage.Querier, in instance, inp input, now time.Time, fields watermill.LogFields) (*transition, error) {
	f := watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id, "state": string(in.state), "current_step": in.step}
	for k, v := range fields {
		f[k] = v
	}
	var t *transition
	err := o.guard.Do("deciding on a saga instance", f, func() error {
		var err error
		t, err = o.decideIn(ctx, q, in, inp, now)
		return err
	})
	return t, err
}

// loadHistory reads what a decision on inp may need of saga id's history,
// in one statement.
func loadHistory(ctx context.Context, q storage.Querier, id string, inp input) (history, error) {
	f := storage.SagaFactsQuery{ID: id, FinalKind: KindCompensated, AttemptKind: KindCompensation}
	if !inp.deadline {
		f.AnsweredStep, f.AnsweredKinds, f.AnsweredAttempt = inp.reply.step, answeredKinds(inp.reply), inp.reply.attempt
	}
	facts, err := storage.LoadSagaFacts(ctx, q, f)
	if err != nil {
		return history{}, err
	}
	return history{loaded: true, answered: facts.Answered, compensated: facts.Final, compAttempts: facts.MaxAttempt}, nil
}

// stage queues transition t on queue: its commands' outbox rows (outbox.Add
// on the queue), then the instance row written over version old (a
// conflict fails the batch: errConflict) and the history; a transition
// whose in.version is 0 writes only history. Queue.Flush sends them all in
// one round trip. It queues all of t or nothing: a transition that can
// never be written (outbox refused one of its commands, or jsonb its
// data: an error for which refused holds) queues nothing, and the caller
// sets the instance aside instead (setAsideRefused).
func (o *Orchestrator[D]) stage(ctx context.Context, queue *storage.Queue, old int64, t *transition) error {
	var ss []storage.Statement
	if t.in.version != 0 {
		var err error
		if ss, err = storage.SagaTransition(t.in.row(), old, steps(t.hist)); err != nil {
			return err
		}
	} else if len(t.hist) > 0 {
		ss = append(ss, storage.SagaSteps(t.in.id, steps(t.hist)))
	}
	// The commands go on a queue of their own first: a refused one leaves
	// none of them queued.
	cmds := storage.NewQueue(queue)
	if err := outbox.Add(ctx, storage.AsTx(cmds), t.events...); err != nil {
		return err
	}
	return queue.Batch(ctx, append(cmds.Statements(), ss...)...)
}

// refused reports whether err (from stage) refuses the transition for
// good: outbox.Add refused one of its commands (outbox.ErrInvalidEvent:
// too large for the transport, a topic it cannot take, a NUL byte, not a
// valid CloudEvent), or its data is not storable (ErrDataNotStorable).
// Writing it again would fail the same way, so the instance is set aside
// rather than retried (a transient error, a database one, is retried).
func refused(err error) bool {
	return errors.Is(err, outbox.ErrInvalidEvent) || errors.Is(err, storage.ErrJSONBRefuses)
}

// refusal says why transition t was refused (err: refused(err) holds)
// and what fixes it, naming the refused command. q is the transaction
// (nothing is written to it).
func (o *Orchestrator[D]) refusal(ctx context.Context, q storage.Querier, t *transition, err error) string {
	resolve := "then `millwright saga resolve " + t.in.id + "`"
	if errors.Is(err, storage.ErrJSONBRefuses) {
		return "its new data cannot be stored; fix the step's OnSuccess (or the reply it copied), " + resolve + ": " + err.Error()
	}
	for _, ev := range t.events {
		// Which command: each alone, on a queue that is thrown away.
		if e := outbox.Add(ctx, storage.AsTx(storage.NewQueue(q)), ev); e != nil {
			return fmt.Sprintf("the outbox refused the %s command %q of step %q (topic %q, %d-byte payload); fix the definition's command (or raise the limit it exceeds: the outbox Writer's, outbox.DefaultMaxEventBytes, or the transport's), %s: %v",
				ev.Metadata[metadata.SagaPhase], ev.EventType, ev.Metadata[metadata.SagaStep], ev.Topic, len(ev.Payload), resolve, e)
		}
	}
	return fmt.Sprintf("the outbox refused its commands; fix the definition's commands, %s: %v", resolve, err)
}

// writeError marks a transition's conflict (storage.ErrConflict: the row
// was no longer at the version read) as errConflict.
func writeError(err error) error {
	if errors.Is(err, storage.ErrConflict) {
		return fmt.Errorf("%w: %w", errConflict, err)
	}
	return err
}
