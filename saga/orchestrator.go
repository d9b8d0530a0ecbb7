package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/schemacheck"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/retry"
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
	// spent its retry budget and an operator must resolve the saga.
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
)

// ErrAlreadyStarted is returned (wrapped) by Start when an instance with the
// id exists: a saga id starts one saga, so a redelivered start request is
// harmless.
var ErrAlreadyStarted = errors.New("saga: instance already exists")

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
	db  *sql.DB
	def *Definition[D]
	cfg Config
	m   metrics

	r *runner.Runner // Run, Close and Running
}

// NewOrchestrator returns an orchestrator of def's instances stored in db
// (with saga, outbox and idempotency migrations applied).
func NewOrchestrator[D any](db *sql.DB, def *Definition[D], cfg Config) (*Orchestrator[D], error) {
	if db == nil {
		return nil, errors.New("saga: NewOrchestrator: db is nil: pass the *sql.DB holding the saga and outbox tables")
	}
	if def == nil {
		return nil, errors.New("saga: NewOrchestrator: definition is nil: build one with saga.Define")
	}
	cfg.setDefaults(def.name)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := &Orchestrator[D]{db: db, def: def, cfg: cfg, r: runner.New("saga.Orchestrator", cfg.CloseTimeout)}
	var err error
	if o.m, err = newMetrics(cfg.Registerer, def.name); err != nil {
		return nil, err
	}
	if err = registerStuck(cfg.Registerer, db, def.name, cfg.Logger); err != nil { // stuck.go
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
		MetricStuck:         "Sagas that entered the stuck state (compensation retries exhausted); resolve with `millwright saga resolve`.",
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

// replyTopicFor returns the reply topic of saga sagaID: one of
// ReplyTopics, the same for every command of the saga.
func (o *Orchestrator[D]) replyTopicFor(sagaID string) string {
	if o.cfg.ReplyShards <= 1 {
		return o.cfg.ReplyTopic
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(sagaID))
	return replyShard(o.cfg.ReplyTopic, int(h.Sum32()%uint32(o.cfg.ReplyShards)))
}

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
}

const instanceColumns = `id, type, state, current_step, data, version, deadline_at, awaiting_reply,
	compensation_attempts, compensation_started_at, last_error, created_at,
	compensation_attempt_base, resume_step, cause`

func scanInstance(sc interface{ Scan(...any) error }) (instance, error) {
	var in instance
	err := sc.Scan(&in.id, &in.typ, &in.state, &in.step, &in.data, &in.version, &in.deadline, &in.awaiting,
		&in.compAttempts, &in.compStarted, &in.lastError, &in.createdAt,
		&in.attemptBase, &in.resumeStep, &in.cause)
	return in, err
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

// transition is what one event does to an instance: the new row, history
// and commands, written together by commit.
type transition struct {
	in     instance
	hist   []histRow
	events []outbox.Event
	// effects run after the statements succeed (metrics, logs).
	effects []func()
}

func (t *transition) record(step, kind, detail string, attempt int, err string) {
	t.hist = append(t.hist, histRow{step: step, kind: kind, detail: detail, attempt: attempt, err: err})
}

// Start creates saga instance id with data and writes the first step's
// command to the outbox, both through exec, normally the caller's
// transaction: the saga starts if and only if it commits. It returns an
// error wrapping ErrAlreadyStarted when the id exists.
func (o *Orchestrator[D]) Start(ctx context.Context, tx outbox.Executor, id string, data D) error {
	// TODO(storage): the saga's statements move to the storage layer.
	exec, ok := tx.(storage.SQLExecutor)
	if !ok {
		return fmt.Errorf("saga %s: Start(%q): %T is not a database/sql executor", o.def.name, id, tx)
	}
	if exec == nil {
		return errors.New("saga: Start: nil Executor: pass the *sql.Tx of the business transaction")
	}
	if id == "" {
		return errors.New("saga: Start: empty saga id: pass a unique id, e.g. the order id or a UUID")
	}
	raw, err := json.Marshal(data)
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): marshalling data %T: %w", o.def.name, id, data, err)
	}
	now := time.Now()
	t := &transition{in: instance{id: id, typ: o.def.name, state: StateRunning, data: raw, awaiting: true, createdAt: now}}
	if err := o.sendCommand(t, 0, data, now); err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, err)
	}
	// One statement inserts the row and its history: a conflict inserts
	// neither. The command goes after it, so a conflict writes no command.
	res, err := exec.ExecContext(ctx, `WITH x AS (INSERT INTO millwright_saga_instances
		(id, type, state, current_step, data, deadline_at, awaiting_reply, created_at, updated_at)
		VALUES (`+litText(id)+`, `+litText(o.def.name)+`, `+litText(string(StateRunning))+`, 0, `+litText(string(raw))+`, `+
		litNullTime(t.in.deadline)+`, true, `+litTime(now)+`, `+litTime(now)+`) ON CONFLICT (id) DO NOTHING RETURNING id) `+histInsert("x", t))
	if err != nil {
		return fmt.Errorf("saga %s: Start(%q): inserting into millwright_saga_instances (did `millwright migrate` run?): %w", o.def.name, id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, ErrAlreadyStarted)
	}
	if err := outbox.Add(ctx, exec, t.events...); err != nil {
		return fmt.Errorf("saga %s: Start(%q): %w", o.def.name, id, err)
	}
	o.m.started.Inc()
	return nil
}

// sendCommand makes step i's command current.
func (o *Orchestrator[D]) sendCommand(t *transition, i int, data D, now time.Time) error {
	s := o.def.steps[i]
	cmd, err := s.Command(data)
	if err != nil {
		return fmt.Errorf("step %q: building command: %w", s.Name, err)
	}
	ev, err := o.event(t.in.id, s.Name, PhaseForward, 1, cmd)
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
func (o *Orchestrator[D]) event(sagaID, step, phase string, attempt int, cmd Command) (outbox.Event, error) {
	if cmd.Topic == "" {
		return outbox.Event{}, errors.New("command has no Topic: set Command.Topic to the participant's command topic")
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
	md[metadata.SagaType] = o.def.name
	md[metadata.SagaStep] = step
	md[metadata.SagaPhase] = phase
	md[metadata.SagaAttempt] = strconv.Itoa(attempt)
	md[metadata.SagaReplyTo] = o.replyTopicFor(sagaID)
	return outbox.Event{
		Topic:         cmd.Topic,
		AggregateType: "saga",
		AggregateID:   sagaID,
		EventType:     cmd.Type,
		Payload:       payload,
		Metadata:      md,
		Source:        o.cfg.Source,
	}, nil
}

// commit writes transition t: the instance row if its version is still
// old, the history and the commands, in one statement without parameters.
// A transition whose in.version is 0 only records history. The instance row
// must be locked by exec's transaction (FOR UPDATE), so its version cannot
// have moved; should it have, the statement fails (errConflict) and the
// transaction must roll back. Nothing reads the statement's result: on a
// pool of postgres.Open it travels with the transaction's COMMIT (or next
// statement), which then fails with the statement's own error (the same
// *pq.Error carrying conflictMessage, not errConflict).
func (o *Orchestrator[D]) commit(ctx context.Context, exec storage.SQLExecutor, old int64, t *transition) error {
	in := t.in
	dctx := pgconn.WithDeferred(ctx, fmt.Sprintf("saga %s %q: writing a transition", o.def.name, in.id))
	if in.version == 0 {
		if _, err := exec.ExecContext(dctx, `WITH x AS (SELECT `+litText(in.id)+`::text AS id) `+histInsert("x", t)); err != nil {
			return fmt.Errorf("recording step history: %w", err)
		}
		return nil
	}
	// The row update and its history in one statement; the history rows
	// exist only if the update matched. No row updated fails the
	// statement: a cast error carrying conflictMessage, which depends on
	// the count so that it is evaluated only then, at run time.
	q := `WITH x AS (UPDATE millwright_saga_instances SET
		state = ` + litText(string(in.state)) + `, current_step = ` + litInt(int64(in.step)) + `, data = ` + litText(string(in.data)) +
		`, version = version + 1, deadline_at = ` + litNullTime(in.deadline) + `, awaiting_reply = ` + litBool(in.awaiting) +
		`, compensation_attempts = ` + litInt(int64(in.compAttempts)) + `, compensation_started_at = ` + litNullTime(in.compStarted) +
		`, last_error = ` + litNullText(in.lastError) + `, compensation_attempt_base = ` + litInt(int64(in.attemptBase)) +
		`, resume_step = ` + litNullInt(in.resumeStep) + `, cause = ` + litNullText(in.cause) + `, updated_at = now()
		WHERE id = ` + litText(in.id) + ` AND version = ` + litInt(old) + ` RETURNING id)`
	if len(t.hist) > 0 {
		q += `, h AS (` + histInsert("x", t) + ` RETURNING 1)`
	}
	q += ` SELECT CASE WHEN count(*) = 0 THEN (` +
		litText(fmt.Sprintf("%s: instance %q is no longer at version %d; rows updated: ", conflictMessage, in.id, old)) +
		` || count(*))::int END FROM x`
	// The commands go first, in the same round trip.
	addLater := false
	if len(t.events) > 0 {
		stmt, ok, err := outboxStatement(ctx, t.events)
		if err != nil {
			return err
		}
		if ok {
			q = stmt + ";\n" + q
		} else {
			addLater = true
		}
	}
	if _, err := exec.ExecContext(dctx, q); err != nil {
		if isConflict(err) {
			return fmt.Errorf("%w: %w", errConflict, err)
		}
		return fmt.Errorf("updating saga instance %q: %w", in.id, err)
	}
	if addLater {
		return outbox.Add(ctx, exec, t.events...)
	}
	return nil
}

// conflictMessage starts the error of a transition statement that
// updated no row.
const conflictMessage = "saga: concurrent transition"

// isConflict reports whether err is a transition statement's failure for
// updating no row (see commit).
func isConflict(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code == "22P02" && strings.Contains(pqErr.Message, conflictMessage)
}

func (o *Orchestrator[D]) decode(in instance) (D, error) {
	var d D
	if err := json.Unmarshal(in.data, &d); err != nil {
		return d, fmt.Errorf("saga %s %q: decoding data into %T: %w", o.def.name, in.id, d, err)
	}
	return d, nil
}

// replyInfo is what a reply message says about itself.
type replyInfo struct {
	sagaID, step, phase string
	attempt             int
	reply               Reply
	stepIdx             int
}

func (o *Orchestrator[D]) parseReply(msg *message.Message) (replyInfo, error) {
	var r replyInfo
	md := msg.Metadata
	r.sagaID = md.Get(metadata.SagaID)
	if r.sagaID == "" {
		return r, fmt.Errorf("saga %s: reply %s has no %q metadata: participants must copy the command's saga keys (use saga.NewReply or saga.ReplyEvent)", o.def.name, msg.UUID, metadata.SagaID)
	}
	if storableText(r.sagaID) != r.sagaID {
		// Saga ids are stored as text: this one cannot name a saga.
		return r, fmt.Errorf("saga %s: reply %s has %s %q that is not valid UTF-8 or holds a NUL byte: no saga has that id", o.def.name, msg.UUID, metadata.SagaID, r.sagaID)
	}
	if typ := md.Get(metadata.SagaType); typ != "" && typ != o.def.name {
		return r, fmt.Errorf("saga %s: reply %s is for saga type %q: give each saga type its own reply topic (Config.ReplyTopic)", o.def.name, msg.UUID, typ)
	}
	r.step, r.phase = md.Get(metadata.SagaStep), md.Get(metadata.SagaPhase)
	idx, ok := o.def.index[r.step]
	if !ok {
		return r, fmt.Errorf("saga %s %q: reply %s names unknown step %q: want one of %s", o.def.name, r.sagaID, msg.UUID, r.step, strings.Join(o.def.Steps(), ", "))
	}
	r.stepIdx = idx
	if r.phase != PhaseForward && r.phase != PhaseCompensation {
		return r, fmt.Errorf("saga %s %q: reply %s has %s %q: want %q or %q", o.def.name, r.sagaID, msg.UUID, metadata.SagaPhase, r.phase, PhaseForward, PhaseCompensation)
	}
	att, err := strconv.Atoi(md.Get(metadata.SagaAttempt))
	if err != nil || att < 1 {
		return r, fmt.Errorf("saga %s %q: reply %s has %s %q: want a positive integer copied from the command", o.def.name, r.sagaID, msg.UUID, metadata.SagaAttempt, md.Get(metadata.SagaAttempt))
	}
	r.attempt = att
	r.reply = Reply{Type: md.Get(metadata.SagaReplyType), Payload: msg.Payload, Metadata: map[string]string(md)}
	if r.reply.Type == "" {
		r.reply.Type = md.Get(metadata.EventType)
	}
	s := o.def.steps[idx]
	want := []string{s.SuccessReply, s.FailureReply}
	if r.phase == PhaseCompensation {
		want = []string{s.CompensatedReply, s.CompensationFailedReply}
	}
	if r.reply.Type != want[0] && r.reply.Type != want[1] {
		return r, fmt.Errorf("saga %s %q: step %q %s reply %s has type %q: want %q or %q (set %s)",
			o.def.name, r.sagaID, r.step, r.phase, msg.UUID, r.reply.Type, want[0], want[1], metadata.SagaReplyType)
	}
	return r, nil
}

// HandleReply applies a participant's reply. Consume Config.ReplyTopic with
// it behind the idempotency middleware: it then writes through the
// middleware's transaction (idempotency.TxFromContext), so the processed
// mark, the state change, the history and the next command commit together.
// Without the middleware it uses a transaction of its own, and a redelivered
// reply is recorded as a duplicate.
//
// A reply that cannot belong to this saga type (no saga id, unknown step or
// reply type) returns an error marked retry.Permanent, for the dead-letter
// path. A reply to a command that is no longer current (the step timed out,
// was compensated, or was answered before) is recorded in the history as
// late_reply or duplicate and acknowledged.
func (o *Orchestrator[D]) HandleReply(msg *message.Message) (err error) {
	r, err := o.parseReply(msg)
	if err != nil {
		return retry.Permanent(err)
	}
	// The step's span continues the reply's trace; the commands this
	// transition writes to the outbox carry it on (outbox.Add stores the
	// traceparent of ctx).
	ctx, span := tracing.Config{TracerProvider: o.cfg.TracerProvider}.StartSagaStep(msg.Context(), o.def.name, r.step, msg)
	defer func() { tracing.EndSpan(span, err) }()
	tx, ok := idempotency.TxFromContext(ctx)
	if ok {
		return o.applyReply(ctx, tx, r)
	}
	own, err := o.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("saga %s %q: begin: %w", o.def.name, r.sagaID, err)
	}
	defer func() { _ = own.Rollback() }()
	if err := o.applyReply(ctx, own, r); err != nil {
		return err
	}
	if err := own.Commit(); err != nil {
		return fmt.Errorf("saga %s %q: commit: %w", o.def.name, r.sagaID, err)
	}
	return nil
}

func (o *Orchestrator[D]) applyReply(ctx context.Context, tx *sql.Tx, r replyInfo) error {
	// FOR UPDATE: of several replies of one saga handled at once (several
	// orchestrator instances, redeliveries), the later ones wait here and
	// read the row the first one left, finding their reply no longer
	// current, instead of computing a transition that conflicts.
	row := tx.QueryRowContext(ctx, `SELECT `+instanceColumns+` FROM millwright_saga_instances WHERE id = `+litText(r.sagaID)+` FOR UPDATE`)
	in, err := scanInstance(row)
	if errors.Is(err, sql.ErrNoRows) {
		return retry.Permanent(fmt.Errorf("saga %s: reply for %q: %w (was the instance deleted?)", o.def.name, r.sagaID, ErrNotFound))
	}
	if err != nil {
		return fmt.Errorf("saga %s %q: loading instance (did `millwright migrate` run?): %w", o.def.name, r.sagaID, err)
	}
	if in.typ != o.def.name {
		return retry.Permanent(fmt.Errorf("saga %s: reply for %q, an instance of saga type %q: give each saga type its own reply topic", o.def.name, r.sagaID, in.typ))
	}
	t, err := o.onReply(ctx, tx, in, r)
	if err != nil {
		return err
	}
	if err := o.commit(ctx, tx, in.version, t); err != nil {
		// errConflict cannot happen under the row lock; should it, the
		// transaction rolls back and the reply is redelivered.
		return fmt.Errorf("saga %s %q: %w", o.def.name, r.sagaID, err)
	}
	for _, f := range t.effects {
		f()
	}
	return nil
}

// onReply computes what reply r does to instance in. A transition whose
// in.version is 0 only records history.
func (o *Orchestrator[D]) onReply(ctx context.Context, tx *sql.Tx, in instance, r replyInfo) (*transition, error) {
	s := o.def.steps[r.stepIdx]
	current := in.step == r.stepIdx && in.awaiting
	histKind := KindReply
	if r.phase == PhaseForward {
		current = current && in.state == StateRunning
	} else {
		histKind = KindCompensationReply
		current = current && in.state == StateCompensating && in.attempt() == r.attempt
	}
	if !current {
		// A late success already acted on counts as an answer, so a second
		// success reply of the same command sends nothing again.
		answeredKind := histKind
		if r.phase == PhaseForward {
			answeredKind = KindLateSuccess
		}
		var answered bool
		if err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM millwright_saga_steps
			WHERE saga_id = $1 AND step = $2 AND kind IN ($3, $4) AND attempt = $5)`,
			in.id, s.Name, histKind, answeredKind, r.attempt).Scan(&answered); err != nil {
			return nil, fmt.Errorf("saga %s %q: reading history: %w", o.def.name, in.id, err)
		}
		// Forward commands are sent once, in order, so an unanswered one
		// that is not current timed out: the saga is compensating (at
		// this step or an earlier one), compensated, or stuck.
		if !answered && r.phase == PhaseForward && r.reply.Type == s.SuccessReply && s.Compensation != nil &&
			in.step <= r.stepIdx && (in.state == StateCompensating || in.state == StateCompensated || in.state == StateStuck) {
			return o.onLateSuccess(ctx, tx, in, r)
		}
		kind, c := KindLateReply, o.m.late
		if answered {
			kind, c = KindDuplicate, o.m.duplicate
		}
		t := &transition{in: instance{id: in.id}}
		t.record(s.Name, kind, r.reply.Type, r.attempt, "")
		t.effects = append(t.effects, c.Inc, func() {
			o.cfg.Logger.Info("saga: reply ignored", watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id,
				"step": s.Name, "phase": r.phase, "attempt": r.attempt, "reply": r.reply.Type, "kind": kind, "state": string(in.state)})
		})
		return t, nil
	}

	now := time.Now()
	t := &transition{in: in}
	data, err := o.decode(in)
	if err != nil {
		return nil, err
	}
	switch r.reply.Type {
	case s.SuccessReply:
		t.record(s.Name, KindReply, r.reply.Type, r.attempt, "")
		if err := o.applySuccess(t, s, &data, r); err != nil {
			return nil, err
		}
		if r.stepIdx+1 == len(o.def.steps) {
			t.in.state, t.in.deadline = StateCompleted, sql.NullTime{}
			t.record(s.Name, KindCompleted, "", 0, "")
			t.effects = append(t.effects, o.m.completed.Inc, func() { o.m.durCompleted.Observe(time.Since(in.createdAt).Seconds()) })
			break
		}
		if err := o.sendCommand(t, r.stepIdx+1, data, now); err != nil {
			// The next step cannot even be asked: it fails, and the steps
			// done so far (this one included) are compensated.
			msg := err.Error()
			t.record(o.def.steps[r.stepIdx+1].Name, KindCommand, "", 1, msg)
			t.in.fail(msg)
			if err := o.compensateFrom(ctx, tx, t, r.stepIdx, data, now); err != nil {
				return nil, err
			}
		}
	case s.FailureReply:
		e := replyError(r.reply)
		t.record(s.Name, KindReply, r.reply.Type, r.attempt, e)
		t.in.fail(fmt.Sprintf("step %q failed: %s", s.Name, e))
		if err := o.compensateFrom(ctx, tx, t, r.stepIdx-1, data, now); err != nil {
			return nil, err
		}
	case s.CompensatedReply:
		t.record(s.Name, KindCompensationReply, r.reply.Type, r.attempt, "")
		next := r.stepIdx - 1
		if in.resumeStep.Valid {
			// This was a late success's compensation: go on with the
			// compensation it interrupted (or back to compensated).
			next, t.in.resumeStep = int(in.resumeStep.Int64), sql.NullInt64{}
		}
		if err := o.compensateFrom(ctx, tx, t, next, data, now); err != nil {
			return nil, err
		}
	case s.CompensationFailedReply:
		e := replyError(r.reply)
		t.record(s.Name, KindCompensationReply, r.reply.Type, r.attempt, e)
		o.compensationFailed(t, fmt.Sprintf("compensation of step %q failed (attempt %d): %s", s.Name, r.attempt, e), now)
	}
	return t, nil
}

// applySuccess updates the saga data from step s's success reply.
func (o *Orchestrator[D]) applySuccess(t *transition, s Step[D], data *D, r replyInfo) error {
	if s.OnSuccess == nil {
		return nil
	}
	if err := s.OnSuccess(data, r.reply); err != nil {
		return fmt.Errorf("saga %s %q: step %q OnSuccess: %w", o.def.name, t.in.id, s.Name, err)
	}
	var err error
	if t.in.data, err = json.Marshal(*data); err != nil {
		return fmt.Errorf("saga %s %q: marshalling data %T: %w", o.def.name, t.in.id, *data, err)
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
func (o *Orchestrator[D]) onLateSuccess(ctx context.Context, q Querier, in instance, r replyInfo) (*transition, error) {
	s := o.def.steps[r.stepIdx]
	now := time.Now()
	t := &transition{in: in}
	data, err := o.decode(in)
	if err != nil {
		return nil, err
	}
	t.record(s.Name, KindLateSuccess, r.reply.Type, r.attempt, "")
	// The compensation may need what the reply says (a reservation id).
	if err := o.applySuccess(t, s, &data, r); err != nil {
		return nil, err
	}
	if in.step != r.stepIdx {
		t.in.resumeStep = sql.NullInt64{Int64: int64(in.step), Valid: true}
	}
	t.in.lastError = in.since(fmt.Sprintf("step %q succeeded after it timed out: undoing it", s.Name))
	if err := o.compensateFrom(ctx, q, t, r.stepIdx, data, now); err != nil {
		return nil, err
	}
	t.effects = append(t.effects, o.m.lateSuccess.Inc, func() {
		o.cfg.Logger.Info("saga: late success: compensating the step", watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id,
			"step": s.Name, "state": string(in.state)})
	})
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
// saga is compensated. q reads the history (the transaction of t).
func (o *Orchestrator[D]) compensateFrom(ctx context.Context, q Querier, t *transition, i int, data D, now time.Time) error {
	for ; i >= 0 && o.def.steps[i].Compensation == nil; i-- {
	}
	t.in.compAttempts, t.in.compStarted, t.in.attemptBase = 0, sql.NullTime{}, 0
	if i < 0 {
		t.in.state, t.in.step, t.in.deadline, t.in.awaiting = StateCompensated, -1, sql.NullTime{}, false
		t.in.resumeStep = sql.NullInt64{}
		if t.in.cause.Valid {
			t.in.lastError = t.in.cause
		}
		t.record("", KindCompensated, "", 0, "")
		// A saga reopened by a late success was counted when it was
		// first compensated.
		var before bool
		if err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM millwright_saga_steps WHERE saga_id = $1 AND kind = $2)`,
			t.in.id, KindCompensated).Scan(&before); err != nil {
			return fmt.Errorf("saga %s %q: reading history: %w", o.def.name, t.in.id, err)
		}
		if !before {
			created := t.in.createdAt
			t.effects = append(t.effects, o.m.compensated.Inc, func() { o.m.durCompensated.Observe(time.Since(created).Seconds()) })
		}
		return nil
	}
	// A step's compensation may run more than once (a late success, an
	// operator's retry): number the new round's attempts after every
	// earlier one, so that a reply to an earlier attempt (one that ran
	// before a late effect, say) is never taken for this round's answer.
	s := o.def.steps[i]
	if err := q.QueryRowContext(ctx, `SELECT COALESCE(max(attempt), 0) FROM millwright_saga_steps
		WHERE saga_id = $1 AND step = $2 AND kind = $3`, t.in.id, s.Name, KindCompensation).Scan(&t.in.attemptBase); err != nil {
		return fmt.Errorf("saga %s %q: reading history: %w", o.def.name, t.in.id, err)
	}
	t.in.state, t.in.step = StateCompensating, i
	o.sendCompensation(t, data, now)
	return nil
}

// sendCompensation sends the next attempt of the current step's
// compensation.
func (o *Orchestrator[D]) sendCompensation(t *transition, data D, now time.Time) {
	s := o.def.steps[t.in.step]
	t.in.compAttempts++
	attempt := t.in.attempt()
	if !t.in.compStarted.Valid {
		t.in.compStarted = sql.NullTime{Time: now, Valid: true}
	}
	cmd, err := s.Compensation(data)
	var ev outbox.Event
	if err == nil {
		ev, err = o.event(t.in.id, s.Name, PhaseCompensation, attempt, cmd)
	}
	if err != nil {
		msg := fmt.Sprintf("compensation of step %q (attempt %d): building command: %v", s.Name, attempt, err)
		t.record(s.Name, KindCompensation, "", attempt, msg)
		o.compensationFailed(t, msg, now)
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
func (o *Orchestrator[D]) compensationFailed(t *transition, reason string, now time.Time) {
	s := o.def.steps[t.in.step]
	t.in.lastError = t.in.since(reason)
	if s.Retry.Exhausted(t.in.compAttempts, now.Sub(t.in.compStarted.Time)) {
		t.in.state, t.in.deadline, t.in.awaiting = StateStuck, sql.NullTime{}, false
		t.record(s.Name, KindStuck, "", t.in.attempt(), reason)
		id, attempts, lastError := t.in.id, t.in.compAttempts, t.in.lastError.String
		t.effects = append(t.effects, o.m.stuck.Inc, func() {
			o.cfg.Logger.Error("saga: stuck: compensation retries exhausted; fix the participant, then run `millwright saga resolve "+id+"`",
				errors.New(lastError), watermill.LogFields{"saga_type": o.def.name, "saga_id": id, "step": s.Name, "attempts": attempts})
		})
		return
	}
	t.in.awaiting = false
	t.in.deadline = sql.NullTime{Time: now.Add(s.Retry.Delay(t.in.compAttempts, 0)), Valid: true}
}

// onDeadline computes what a passed deadline does to instance in, whose
// data is data; q is the transaction that claimed it.
func (o *Orchestrator[D]) onDeadline(ctx context.Context, q Querier, in instance, data D, now time.Time) (*transition, error) {
	t := &transition{in: in}
	var err error
	switch {
	case in.state == StateRunning:
		s := o.def.steps[in.step]
		msg := fmt.Sprintf("step %q timed out after %s", s.Name, s.Timeout)
		t.record(s.Name, KindTimeout, "", 1, msg)
		t.in.fail(msg)
		// The step's outcome is unknown: it may have taken effect and its
		// reply be late. Its own compensation runs too; should its
		// success still arrive, onLateSuccess sends the compensation
		// again. Compensations must therefore accept commands whose
		// forward effect never happened.
		t.effects = append(t.effects, func() {
			o.cfg.Logger.Info("saga: step timed out", watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id, "step": s.Name})
		})
		err = o.compensateFrom(ctx, q, t, in.step, data, now)
	case in.state == StateCompensating && in.step < 0:
		err = o.compensateFrom(ctx, q, t, -1, data, now)
	case in.state == StateCompensating && in.awaiting:
		s := o.def.steps[in.step]
		msg := fmt.Sprintf("compensation of step %q (attempt %d) timed out after %s", s.Name, in.attempt(), s.CompensationTimeout)
		t.record(s.Name, KindTimeout, "", in.attempt(), msg)
		o.compensationFailed(t, msg, now)
	case in.state == StateCompensating && in.compAttempts == 0:
		// Resolved by an operator: start afresh at the current step.
		err = o.compensateFrom(ctx, q, t, in.step, data, now)
	case in.state == StateCompensating:
		o.sendCompensation(t, data, now)
	default:
		// Final or stuck states have no deadline; clear a stray one.
		t.in.deadline = sql.NullTime{}
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

// Running is closed once Run has started its loop.
func (o *Orchestrator[D]) Running() <-chan struct{} { return o.r.Running() }

// Run fires due deadlines until ctx ends or Close is called: step timeouts
// start compensation, compensation timeouts and backoffs resend, and sagas
// an operator resolved resume. Each round claims up to BatchSize due
// instances of this saga type with FOR UPDATE SKIP LOCKED, so every
// orchestrator instance may run it; a deadline is fired by one of them, and
// survives restarts because it is a column. Database errors are logged and
// the round is retried after PollInterval. Run returns nil after Close or
// when ctx ends; a second Run before Close returns an error.
//
// Before its first round Run checks that the saga tables
// (millwright_saga_instances, millwright_saga_steps) exist in the
// search_path of its *sql.DB, and returns an error naming those missing
// and the fix (`millwright migrate`) if they do not; while the database
// cannot be asked, it logs and asks again after PollInterval.
func (o *Orchestrator[D]) Run(ctx context.Context) error {
	return o.r.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		var wait time.Duration // the first round at once
		checked := false
		for runner.Wait(ctx, draining, wait) {
			if !checked {
				err := schemacheck.Check(ctx, o.db, "saga "+o.def.name, sagaTables...)
				var missing *schemacheck.MissingError
				switch {
				case errors.As(err, &missing):
					return err
				case err != nil && ctx.Err() != nil:
					return nil
				case err != nil:
					o.cfg.Logger.Error("saga: checking its tables at start", err, watermill.LogFields{"saga_type": o.def.name})
					wait = o.cfg.PollInterval
					continue
				}
				checked = true
			}
			n, err := o.RunOnce(ctx)
			wait = o.cfg.PollInterval
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

// sagaTables are the tables an orchestrator works on: Run checks they
// exist before it starts.
var sagaTables = []string{"millwright_saga_instances", "millwright_saga_steps"}

// RunOnce fires up to BatchSize due deadlines in one transaction and
// returns how many it fired.
func (o *Orchestrator[D]) RunOnce(ctx context.Context) (int, error) {
	tx, err := o.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("saga %s: begin: %w", o.def.name, err)
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, `SELECT `+instanceColumns+` FROM millwright_saga_instances
		WHERE type = $1 AND deadline_at <= now()
		ORDER BY deadline_at LIMIT $2 FOR UPDATE SKIP LOCKED`, o.def.name, o.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("saga %s: claiming due deadlines (did `millwright migrate` run?): %w", o.def.name, err)
	}
	var due []instance
	for rows.Next() {
		in, err := scanInstance(rows)
		if err != nil {
			rows.Close()
			return 0, fmt.Errorf("saga %s: scanning instance: %w", o.def.name, err)
		}
		due = append(due, in)
	}
	if err := rows.Close(); err != nil {
		return 0, err
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("saga %s: claiming due deadlines: %w", o.def.name, err)
	}
	var effects []func()
	now := time.Now()
	for _, in := range due {
		var t *transition
		data, err := o.decode(in)
		if err == nil {
			if t, err = o.onDeadline(ctx, tx, in, data, now); err != nil {
				return 0, err
			}
		} else {
			// Undecodable data: the saga cannot go on; park it for an
			// operator rather than retrying it every round.
			t = &transition{in: in}
			t.in.state, t.in.deadline = StateStuck, sql.NullTime{}
			t.in.lastError = sql.NullString{String: err.Error(), Valid: true}
			t.record("", KindStuck, "", 0, err.Error())
			t.effects = append(t.effects, o.m.stuck.Inc)
		}
		// The row is locked by this transaction: the version cannot move.
		if err := o.commit(ctx, tx, in.version, t); err != nil {
			return 0, fmt.Errorf("saga %s %q: %w", o.def.name, in.id, err)
		}
		effects = append(effects, t.effects...)
	}
	if len(due) == 0 {
		return 0, nil
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("saga %s: commit of %d fired deadline(s): %w", o.def.name, len(due), err)
	}
	for _, f := range effects {
		f()
	}
	return len(due), nil
}

// Close stops Run, waiting up to CloseTimeout for the round in flight (its
// transaction then rolls back and another instance fires those deadlines).
// It is idempotent. Close the reply consumers (the router) separately.
func (o *Orchestrator[D]) Close() error { return o.r.Close() }
