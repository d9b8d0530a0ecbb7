package saga

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/schemacheck"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/tracing"
)

// State is the state of a saga instance.
type State string

// Saga states. Completed and Compensated are final; Stuck waits for an
// operator (Resolve, `millwright saga resolve`).
const (
	StateRunning      State = "running"
	StateCompensating State = "compensating"
	StateCompleted    State = "completed"
	StateCompensated  State = "compensated"
	StateStuck        State = "stuck"
)

// Phases, the values of metadata.SagaPhase.
const (
	PhaseForward      = "forward"
	PhaseCompensation = "compensation"
)

// History kinds, the kind column of millwright_saga_steps.
const (
	KindCommand           = "command"
	KindCompensation      = "compensation"
	KindReply             = "reply"
	KindCompensationReply = "compensation_reply"
	KindTimeout           = "timeout"
	KindLateReply         = "late_reply"
	KindDuplicate         = "duplicate"
	KindStuck             = "stuck"
	KindResolved          = "resolved"
	KindCompleted         = "completed"
	KindCompensated       = "compensated"
	// KindLateSuccess is a success reply that arrived after its step timed
	// out, for a step with a Compensation: the compensation is sent in the
	// same transition. (A late success of a NoCompensation step, and any
	// other late reply, is a KindLateReply.)
	KindLateSuccess = "late_success"
)

// Metric names, each with a "type" label (the saga type).
const (
	// MetricStarted counts sagas started.
	MetricStarted = "millwright_saga_started_total"
	// MetricCompleted counts sagas whose every step succeeded.
	MetricCompleted = "millwright_saga_completed_total"
	// MetricCompensated counts sagas that failed and were fully compensated.
	MetricCompensated = "millwright_saga_compensated_total"
	// MetricStuck counts sagas that entered the stuck state: a compensation
	// spent its retry budget, or no decision could be made on the saga or
	// the one made can never be written (it was set aside: see RunOnce and
	// HandleReply), and an operator must resolve it.
	MetricStuck = "millwright_saga_stuck_total"
	// MetricIgnoredReplies counts replies recorded and ignored, with a
	// "kind" label: late_reply or duplicate.
	MetricIgnoredReplies = "millwright_saga_ignored_replies_total"
	// MetricLateSuccesses counts success replies that arrived after their
	// step timed out and made the orchestrator send that step's
	// compensation (the late success of a NoCompensation step counts as an
	// ignored late_reply instead).
	MetricLateSuccesses = "millwright_saga_late_successes_total"
	// MetricDuration observes the seconds from start to completed or
	// compensated, with an "outcome" label (completed, compensated).
	MetricDuration = "millwright_saga_duration_seconds"
	// MetricLoopPanics counts the panics a long-running loop recovered
	// from, with a "component" label (here saga.Orchestrator): the
	// definition's code (a Command, Compensation or OnSuccess) panicked on
	// an instance. Run sets that instance aside as stuck, naming the
	// panic; HandleReply refuses the reply with a failure.Permanent error.
	// The same series counts the other loops' panics (outbox relay,
	// cleaners).
	MetricLoopPanics = "millwright_loop_panics_total"
)

// ErrAlreadyStarted is returned (wrapped) by Start when an instance with the
// id exists: a saga id starts one saga, so a redelivered start request is
// harmless.
var ErrAlreadyStarted = errors.New("saga: instance already exists")

// ErrDataNotStorable is returned (wrapped) by Start for saga data the
// instances table's jsonb column cannot hold: a string or key with a NUL
// character (JSON's \u0000), an unpaired UTF-16 surrogate escape, a
// number beyond Postgres numeric. The message names the field (a JSON
// path, $.note). A transition whose new data (from a step's OnSuccess) is
// such sets the instance aside as stuck instead, with that message in its
// last_error (see HandleReply).
var ErrDataNotStorable = storage.ErrJSONBRefuses

// ErrNotFound is returned (wrapped) when no saga instance has the id.
var ErrNotFound = errors.New("saga: instance not found")

// errConflict means another transition of the instance committed first.
var errConflict = errors.New("saga: concurrent transition")

// Config configures an Orchestrator.
type Config struct {
	// ReplyTopic is the topic participants reply to (carried on every
	// command as metadata.SagaReplyTo). Consume it with HandleReply.
	// Default the definition's name + "_replies".
	ReplyTopic string
	// ReplyShards spreads replies over that many topics, by saga id:
	// ReplyTopic, then ReplyTopic + "_1" … "_N-1" (ReplyTopics lists
	// them; consume each with HandleReply). All replies of one saga go to
	// one of them. A transport that hands a topic's messages to its
	// consumers one at a time (watermill-sql's consumer group; a
	// RabbitMQ queue with one consumer) then applies N replies at once
	// instead of one. Kafka's partitions already do this: leave it at 1
	// there. Lowering it leaves replies of running sagas on the dropped
	// topics: consume those until they are empty. Default 1; valid 1..64.
	ReplyShards int
	// PollInterval is how often Run looks for due deadlines (step timeouts,
	// compensation backoffs, resolved sagas). A step timeout fires at most
	// this late. Default 1s; minimum 1ms.
	PollInterval time.Duration
	// BatchSize is the most due instances Run claims in one transaction.
	// Default 100; valid 1..10000.
	BatchSize int
	// Source is the CloudEvents source of commands. Default "" (none).
	Source string
	// CloseTimeout bounds how long Close waits for the round in flight.
	// Default 30s.
	CloseTimeout time.Duration
	// Registerer receives the Metric* series. Default nil: none registered
	// (counters still work, unexported). Orchestrators sharing a Registerer
	// share the series, told apart by the type label.
	Registerer prometheus.Registerer
	// TracerProvider makes the "saga step" spans of HandleReply. Default
	// nil: the global provider (otel.GetTracerProvider()).
	TracerProvider trace.TracerProvider
	// Logger. Default watermill.NopLogger. Stuck sagas are logged at error
	// level, timeouts and ignored replies at info.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults(name string) {
	if c.ReplyTopic == "" {
		c.ReplyTopic = name + "_replies"
	}
	if c.ReplyShards == 0 {
		c.ReplyShards = 1
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, naming it.
func (c Config) Validate() error {
	var errs []error
	if c.ReplyShards < 1 || c.ReplyShards > maxReplyShards {
		errs = append(errs, fmt.Errorf("saga: Config.ReplyShards %d: want 1..%d", c.ReplyShards, maxReplyShards))
	}
	if c.PollInterval < time.Millisecond {
		errs = append(errs, fmt.Errorf("saga: Config.PollInterval %s: want at least 1ms", c.PollInterval))
	}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		errs = append(errs, fmt.Errorf("saga: Config.BatchSize %d: want 1..10000", c.BatchSize))
	}
	if _, err := url.Parse(c.Source); err != nil || !utf8.ValidString(c.Source) || strings.ContainsRune(c.Source, 0) {
		// Every command would be refused by outbox.Add.
		errs = append(errs, fmt.Errorf("saga: Config.Source %q is not a URI-reference (the CloudEvents source of every command): use a path such as \"/orders-service\" or an absolute URI", c.Source))
	}
	if c.CloseTimeout < 0 {
		errs = append(errs, fmt.Errorf("saga: Config.CloseTimeout %s is negative", c.CloseTimeout))
	}
	return errors.Join(errs...)
}

type metrics struct {
	started, completed, compensated, stuck prometheus.Counter
	late, duplicate, lateSuccess           prometheus.Counter
	durCompleted, durCompensated           prometheus.Observer
}

// Orchestrator runs the instances of one saga type: it starts them, applies
// replies (HandleReply) and fires deadlines (Run). Any number of
// orchestrators of one type may run at once, in one process or many; each
// transition commits once. It is safe for concurrent use.
type Orchestrator[D any] struct {
	pool storage.Pool
	def  *Definition[D]
	cfg  Config
	d    decider[D]
	m    metrics
	// guard recovers a panic of the definition's code on one instance.
	guard *runner.Guard

	r *runner.Runner // Run, Close and Running
}

// NewOrchestrator returns an orchestrator of def's instances stored in db,
// a *sql.DB or a *pgxpool.Pool (with saga, outbox and idempotency
// migrations applied).
func NewOrchestrator[D any](db postgres.DB, def *Definition[D], cfg Config) (*Orchestrator[D], error) {
	if err := db.Valid(); err != nil {
		return nil, fmt.Errorf("saga: NewOrchestrator: pass the database holding the saga and outbox tables: %w", err)
	}
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("saga: NewOrchestrator: %w", err)
	}
	if def == nil {
		return nil, errors.New("saga: NewOrchestrator: definition is nil: build one with saga.Define")
	}
	cfg.setDefaults(def.name)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := &Orchestrator[D]{pool: pool, def: def, cfg: cfg, d: decider[D]{def: def, cfg: cfg},
		r: runner.New("saga.Orchestrator", cfg.CloseTimeout)}
	if o.m, err = newMetrics(cfg.Registerer, def.name); err != nil {
		return nil, err
	}
	if o.guard, err = runner.NewGuard("saga.Orchestrator", cfg.Registerer, cfg.Logger); err != nil {
		return nil, err
	}
	if err = registerStuck(cfg.Registerer, pool, def.name, cfg.Logger); err != nil { // stuck.go
		return nil, err
	}
	return o, nil
}

func newMetrics(reg prometheus.Registerer, typ string) (metrics, error) {
	var m metrics
	counters := map[string]*prometheus.CounterVec{}
	for name, help := range map[string]string{
		MetricStarted:       "Sagas started.",
		MetricCompleted:     "Sagas whose every step succeeded.",
		MetricCompensated:   "Sagas that failed and were fully compensated.",
		MetricStuck:         "Sagas that entered the stuck state (compensation retries exhausted, or set aside: no decision could be made on them); resolve with `millwright saga resolve`.",
		MetricLateSuccesses: "Successes that arrived after their step timed out; the step's compensation was sent.",
	} {
		vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"type"})
		if err := register(reg, &vec); err != nil {
			return m, err
		}
		counters[name] = vec
	}
	ignored := prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricIgnoredReplies,
		Help: "Saga replies recorded in the step history and ignored (late or duplicate)."}, []string{"type", "kind"})
	if err := register(reg, &ignored); err != nil {
		return m, err
	}
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricDuration,
		Help:    "Seconds from saga start to its final state.",
		Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 12)}, []string{"type", "outcome"})
	if err := register(reg, &dur); err != nil {
		return m, err
	}
	m.started = counters[MetricStarted].WithLabelValues(typ)
	m.completed = counters[MetricCompleted].WithLabelValues(typ)
	m.compensated = counters[MetricCompensated].WithLabelValues(typ)
	m.stuck = counters[MetricStuck].WithLabelValues(typ)
	m.lateSuccess = counters[MetricLateSuccesses].WithLabelValues(typ)
	m.late = ignored.WithLabelValues(typ, KindLateReply)
	m.duplicate = ignored.WithLabelValues(typ, KindDuplicate)
	m.durCompleted = dur.WithLabelValues(typ, string(StateCompleted))
	m.durCompensated = dur.WithLabelValues(typ, string(StateCompensated))
	return m, nil
}

// register registers *c, or replaces it with the collector already
// registered under its name.
func register[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	if reg == nil {
		return nil
	}
	var err error
	if *c, err = promreg.Register(reg, *c); err != nil {
		return fmt.Errorf("saga: registering metrics: %w", err)
	}
	return nil
}

// Definition returns the saga type the orchestrator runs.
func (o *Orchestrator[D]) Definition() *Definition[D] { return o.def }

// ReplyTopic returns the topic to consume with HandleReply (the first of
// ReplyTopics).
func (o *Orchestrator[D]) ReplyTopic() string { return o.cfg.ReplyTopic }

// maxReplyShards bounds Config.ReplyShards.
const maxReplyShards = 64

// ReplyTopics returns every topic participants reply to
// (Config.ReplyShards of them): consume each with HandleReply.
func (o *Orchestrator[D]) ReplyTopics() []string {
	topics := make([]string, o.cfg.ReplyShards)
	for i := range topics {
		topics[i] = replyShard(o.cfg.ReplyTopic, i)
	}
	return topics
}

// replyShard names reply topic i of base.
func replyShard(base string, i int) string {
	if i == 0 {
		return base
	}
	return base + "_" + strconv.Itoa(i)
}

// Start creates saga instance id with data and writes the first step's
// command to the outbox, both in tx, the caller's transaction: the saga
// starts if and only if it commits. It returns an error wrapping ErrAlreadyStarted when the id
// exists; the transaction is then left usable, and nothing is written.
// StartOutsideTx starts saga id in a transaction of its own on db: for a
// caller with no business rows to commit beside it. A service that writes
// its own rows in the same unit of work calls Start with that transaction,
// or a saga may start for a change that never committed.
func (o *Orchestrator[D]) StartOutsideTx(ctx context.Context, db postgres.DB, id string, data D) error {
	return db.InTx(ctx, func(tx postgres.Tx) error { return o.Start(ctx, tx, id, data) })
}

func (o *Orchestrator[D]) Start(ctx context.Context, tx postgres.Tx, id string, data D) error {
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, err)
	}
	if id == "" {
		return errors.New("saga: Start: empty saga id: pass a unique id, e.g. the order id or a UUID")
	}
	t, err := o.d.decideStart(id, data, time.Now())
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, err)
	}
	if err := storage.CheckJSONB(t.in.data); err != nil {
		return fmt.Errorf("saga %s: Start(%q): its data: %w", o.def.name, id, err)
	}
	// One statement inserts the row and its history: a conflict inserts
	// neither. The command goes after it, so a conflict writes no command.
	inserted, err := storage.InsertSaga(ctx, q, t.in.row(), steps(t.hist))
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): inserting into millwright_saga_instances%s: %w", o.def.name, id, storage.Hint(err), err)
	}
	if !inserted {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, ErrAlreadyStarted)
	}
	if err := outbox.Add(ctx, tx, t.events...); err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, err)
	}
	o.m.started.Inc()
	return nil
}

// isNil reports whether x is nil or a nil pointer (a nil *sql.Tx).
func isNil(x any) bool {
	if x == nil {
		return true
	}
	v := reflect.ValueOf(x)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// HandleReply applies a participant's reply. Consume Config.ReplyTopic with
// it behind the idempotency middleware: it then writes through the
// middleware's transaction (idempotency.TxFromContext,
// on either driver), so the processed
// mark, the state change, the history and the next command commit together.
// Without the middleware it uses a transaction of its own on the
// orchestrator's pool, and a redelivered reply is recorded as a duplicate.
//
// A reply that cannot belong to this saga type (no saga id, unknown step or
// reply type) returns an error marked failure.Permanent, for the dead-letter
// path. A reply to a command that is no longer current (the step timed out,
// was compensated, or was answered before) is recorded in the history as
// late_reply or duplicate and acknowledged. A reply whose transition can
// never be written (the outbox refuses the command it would send:
// outbox.ErrInvalidEvent; or the step's OnSuccess made data the table
// cannot hold: ErrDataNotStorable) sets the instance aside as stuck in
// the same transaction (last_error names the reply, the refused command
// or data field and the fix; the history records the reply, so a
// redelivery is a duplicate) and is acknowledged: redelivering it would
// fail the same way forever.
func (o *Orchestrator[D]) HandleReply(msg *message.Message) (err error) {
	r, err := o.d.parseReply(msg)
	if err != nil {
		return failure.Permanent(err)
	}
	// The step's span continues the reply's trace; the commands this
	// transition writes to the outbox carry it on (outbox.Add stores the
	// traceparent of ctx).
	ctx, span := tracing.Config{TracerProvider: o.cfg.TracerProvider}.StartSagaStep(msg.Context(), o.def.name, r.step, msg)
	defer func() { tracing.EndSpan(span, err) }()
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		q, err := storage.FromTx(tx)
		if err != nil {
			return fmt.Errorf("saga %s %q: the idempotency middleware's transaction: %w", o.def.name, r.sagaID, err)
		}
		t, err := o.applyReply(ctx, q, r)
		if err != nil {
			return err
		}
		o.report(t)
		return nil
	}
	own, err := o.pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return fmt.Errorf("saga %s %q: begin: %w", o.def.name, r.sagaID, err)
	}
	defer func() { _ = own.Rollback(context.WithoutCancel(ctx)) }()
	t, err := o.applyReply(ctx, own, r)
	if err != nil {
		return err
	}
	// Reported once written, before the commit makes the new state
	// visible, as in the middleware's transaction: whoever sees the state
	// sees its metrics.
	o.report(t)
	if err := own.Commit(ctx); err != nil {
		return fmt.Errorf("saga %s %q: commit: %w", o.def.name, r.sagaID, err)
	}
	return nil
}

// applyReply is a reply's load, decide and write, in q's transaction.
func (o *Orchestrator[D]) applyReply(ctx context.Context, q storage.Querier, r replyInfo) (*transition, error) {
	// FOR UPDATE: of several replies of one saga handled at once (several
	// orchestrator instances, redeliveries), the later ones wait here and
	// read the row the first one left, finding their reply no longer
	// current, instead of computing a transition that conflicts.
	row, err := storage.LockSaga(ctx, q, r.sagaID)
	if storage.IsNoRows(err) {
		return nil, failure.Permanent(fmt.Errorf("saga %s: reply for %q: %w (was the instance deleted?)", o.def.name, r.sagaID, ErrNotFound))
	}
	if err != nil {
		return nil, fmt.Errorf("saga %s %q: loading instance%s: %w", o.def.name, r.sagaID, storage.Hint(err), err)
	}
	in := fromRow(row)
	if in.typ != o.def.name {
		return nil, failure.Permanent(fmt.Errorf("saga %s: reply for %q, an instance of saga type %q: give each saga type its own reply topic", o.def.name, r.sagaID, in.typ))
	}
	t, err := o.decideGuarded(ctx, q, in, input{reply: r}, time.Now(), watermill.LogFields{"reply": r.reply.Type, "step": r.step})
	var le *loadError
	switch {
	case errors.As(err, &le):
		return nil, err
	case undecidable(err):
		// No decision can be made on this reply (the instance's position
		// is not in the definition, or the definition's code panicked on
		// it): redelivering it would fail the same way.
		return nil, failure.Permanent(fmt.Errorf("saga %s: reply %s to step %q of %q: %w", o.def.name, r.reply.Type, r.step, r.sagaID, err))
	case err != nil:
		// Any other error of the definition's code (OnSuccess, a
		// Compensation builder) may pass: the reply is redelivered, as
		// Definition's doc says.
		return nil, err
	}
	queue := storage.NewQueue(q)
	err = o.stage(ctx, queue, in.version, t)
	if refused(err) {
		// The transition can never be written (a command the outbox
		// refuses, data jsonb refuses): every redelivery would fail the
		// same way. The instance is set aside, and the reply recorded
		// and acknowledged.
		reason := fmt.Sprintf("reply %s to step %q (attempt %d): %s", r.reply.Type, r.step, r.attempt, o.refusal(ctx, q, t, err))
		t = o.d.setAsideRefused(in, t, reason, !errors.Is(err, storage.ErrJSONBRefuses))
		err = o.stage(ctx, queue, in.version, t)
	}
	if err == nil {
		err = queue.Flush(ctx)
	}
	if err != nil {
		// errConflict cannot happen under the row lock; should it, the
		// transaction rolls back and the reply is redelivered.
		return nil, fmt.Errorf("saga %s %q: %w", o.def.name, r.sagaID, writeError(err))
	}
	return t, nil
}

// report publishes what transition t did (metrics, logs), once written.
func (o *Orchestrator[D]) report(t *transition) {
	typ, id := o.def.name, t.in.id
	for _, n := range t.notes {
		switch n.what {
		case noteCompleted:
			o.m.completed.Inc()
			o.m.durCompleted.Observe(time.Since(t.in.createdAt).Seconds())
		case noteCompensated:
			o.m.compensated.Inc()
			o.m.durCompensated.Observe(time.Since(t.in.createdAt).Seconds())
		case noteStuck:
			o.m.stuck.Inc()
			if n.step != "" {
				what := "compensation retries exhausted"
				if n.phase == PhaseForward { // wait.go: a Retriable step
					what = "retries of the Retriable step's command exhausted"
				}
				o.cfg.Logger.Error("saga: stuck: "+what+"; fix the participant, then run `millwright saga resolve "+id+"`",
					errors.New(t.in.lastError.String), watermill.LogFields{"saga_type": typ, "saga_id": id, "step": n.step, "attempts": n.attempt})
			}
		case noteTimeout:
			o.cfg.Logger.Info("saga: step timed out", watermill.LogFields{"saga_type": typ, "saga_id": id, "step": n.step})
		case noteIgnored:
			c := o.m.late
			if n.kind == KindDuplicate {
				c = o.m.duplicate
			}
			c.Inc()
			o.cfg.Logger.Info("saga: reply ignored", watermill.LogFields{"saga_type": typ, "saga_id": id,
				"step": n.step, "phase": n.phase, "attempt": n.attempt, "reply": n.reply, "kind": n.kind, "state": string(n.state)})
		case noteSetAside:
			o.m.stuck.Inc()
			o.cfg.Logger.Error("saga: set aside as stuck: no decision can be made on it, or its transition can never be written; see its last_error, then `millwright saga resolve "+id+"`",
				errors.New(n.reply), watermill.LogFields{"saga_type": typ, "saga_id": id, "step": n.step, "state": string(n.state)})
		case noteLateSuccess:
			o.m.lateSuccess.Inc()
			o.cfg.Logger.Info("saga: late success: compensating the step", watermill.LogFields{"saga_type": typ, "saga_id": id,
				"step": n.step, "state": string(n.state)})
		}
	}
}

// Running is closed once Run has started its loop.
func (o *Orchestrator[D]) Running() <-chan struct{} { return o.r.Running() }

// Run fires due deadlines until ctx ends or Close is called: step timeouts
// start compensation, compensation timeouts and backoffs resend, and sagas
// an operator resolved resume. Each round claims up to BatchSize due
// instances of this saga type with FOR UPDATE SKIP LOCKED, so every
// orchestrator instance may run it; a deadline is fired by one of them, and
// survives restarts because it is a column. Database errors are logged and
// the round is retried after PollInterval; a panic is recovered, logged,
// counted (MetricLoopPanics) and the round retried the same way, and an
// instance no decision can be made on is set aside (see RunOnce), so no
// instance stops the loop. Run returns nil after Close or
// when ctx ends; a second Run before Close returns an error.
//
// Before its first round Run checks that the saga tables
// (millwright_saga_instances, millwright_saga_steps) exist in the
// search_path of its pool, and returns an error naming those missing
// and the fix (`millwright migrate`) if they do not; while the database
// cannot be asked, it logs and asks again after PollInterval.
func (o *Orchestrator[D]) Run(ctx context.Context) error {
	return o.r.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		var wait time.Duration // the first round at once
		checked := false
		for runner.Wait(ctx, draining, wait) {
			wait = o.cfg.PollInterval
			if !checked {
				err := o.checkTables(ctx)
				var missing *schemacheck.MissingError
				switch {
				case errors.As(err, &missing):
					return err
				case err != nil && ctx.Err() != nil:
					return nil
				case err != nil:
					o.cfg.Logger.Error("saga: checking its tables at start", err, watermill.LogFields{"saga_type": o.def.name})
					continue
				}
				checked = true
			}
			var n int
			// A panic outside one instance's decision (the instances' own
			// are set aside by RunOnce) fails the round, not the loop.
			err := o.guard.Do("firing deadlines", watermill.LogFields{"saga_type": o.def.name}, func() (err error) {
				n, err = o.RunOnce(ctx)
				return err
			})
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				o.cfg.Logger.Error("saga: firing deadlines", err, watermill.LogFields{"saga_type": o.def.name})
			} else if n == o.cfg.BatchSize {
				wait = 0 // more may be due
			}
		}
		return nil
	})
}

// checkTables checks that the saga tables are on the orchestrator's
// pool's search_path (a *schemacheck.MissingError names those that are
// not), whichever its driver.
func (o *Orchestrator[D]) checkTables(ctx context.Context) error {
	return schemacheck.Check(ctx, o.pool, "saga "+o.def.name, storage.SagaTables...)
}

// RunOnce fires up to BatchSize due deadlines in one transaction and
// returns how many it fired. The transitions are written in one batch.
// An instance no decision can be made on (its position is not a step of
// the definition: ErrUnknownPosition; or the definition's code panicked on
// it, counted in MetricLoopPanics), or whose transition can never be
// written (the outbox refuses a command it would send, outbox.ErrInvalidEvent:
// a payload past the transport's size limit, a topic it cannot take; or
// its data is not storable, ErrDataNotStorable) is set aside in the same
// batch: it becomes stuck, sending nothing, its last_error and a stuck
// history row say why (naming the refused command and the fix), and the
// others' deadlines are fired as usual. A database error fails the round,
// which is retried.
func (o *Orchestrator[D]) RunOnce(ctx context.Context) (int, error) {
	tx, err := o.pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return 0, fmt.Errorf("saga %s: begin: %w", o.def.name, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := storage.ClaimDueSagas(ctx, tx, o.def.name, o.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("saga %s: claiming due deadlines%s: %w", o.def.name, storage.Hint(err), err)
	}
	if len(rows) == 0 {
		return 0, nil
	}
	now := time.Now()
	queue := storage.NewQueue(tx)
	ts := make([]*transition, 0, len(rows))
	for _, row := range rows {
		in := fromRow(row)
		t, err := o.decideGuarded(ctx, tx, in, input{deadline: true}, now, nil)
		var le *loadError
		switch {
		case errors.As(err, &le):
			return 0, err
		case undecidable(err):
			// One instance no decision can be made on (its position is
			// not in the definition, or the definition's code panicked
			// on it) must not hold back the others' deadlines, nor be
			// fired again every round: it is set aside for an operator.
			t = o.d.setAside(in, err.Error())
		case err != nil:
			// Any other error of the definition's code (a Compensation
			// builder) may pass: this instance's deadline is tried again
			// next round, and the others' fire now.
			o.cfg.Logger.Error("saga: deciding on an overdue instance failed; trying it again next round", err,
				watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id, "current_step": in.step})
			continue
		}
		// The row is locked by this transaction: the version cannot move.
		err = o.stage(ctx, queue, in.version, t)
		if refused(err) {
			// The transition can never be written (a command the outbox
			// refuses, data jsonb refuses): failing the batch would
			// claim this instance first again every round, and no
			// deadline of this saga type would fire again. It is set
			// aside instead, and the others' deadlines are fired.
			t = o.d.setAsideRefused(in, t, o.refusal(ctx, tx, t, err), !errors.Is(err, storage.ErrJSONBRefuses))
			err = o.stage(ctx, queue, in.version, t)
		}
		if err != nil {
			return 0, fmt.Errorf("saga %s %q: %w", o.def.name, in.id, err)
		}
		ts = append(ts, t)
	}
	if err := queue.Flush(ctx); err != nil {
		return 0, fmt.Errorf("saga %s: writing %d fired deadline(s): %w", o.def.name, len(rows), writeError(err))
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("saga %s: commit of %d fired deadline(s): %w", o.def.name, len(rows), err)
	}
	for _, t := range ts {
		o.report(t)
	}
	return len(rows), nil
}

// Close stops Run, waiting up to CloseTimeout for the round in flight (its
// transaction then rolls back and another instance fires those deadlines).
// It is idempotent. Close the reply consumers (the router) separately.
func (o *Orchestrator[D]) Close() error { return o.r.Close() }

// undecidable reports whether err says that no decision can ever be made
// on an instance: its position is not a step of the definition, or the
// definition's code panicked on it. Other errors of the definition's code
// may be transient, and are retried.
func undecidable(err error) bool {
	return errors.Is(err, ErrUnknownPosition) || runner.IsPanic(err)
}
