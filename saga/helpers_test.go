package saga_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
)

// Order is the saga data of the test saga.
type Order struct {
	ID            string `json:"id"`
	Amount        int    `json:"amount"`
	ReservationID string `json:"reservation_id,omitempty"`
	PaymentID     string `json:"payment_id,omitempty"`
}

// topics of one test run: unique, so runs sharing a broker do not mix.
type topics struct{ inventory, payment, shipping, replies string }

func newTopics() topics {
	var r [4]byte
	_, _ = rand.Read(r[:])
	s := hex.EncodeToString(r[:])
	return topics{"saga_inventory_" + s, "saga_payment_" + s, "saga_shipping_" + s, "saga_replies_" + s}
}

func (tp topics) all() []string { return []string{tp.inventory, tp.payment, tp.shipping, tp.replies} }

type defOpts struct {
	// timeouts of the steps' commands by step name; default 30s.
	timeouts map[string]time.Duration
	// compTimeouts of the steps' compensations by step name; default 30s.
	compTimeouts map[string]time.Duration
	retry        retry.Policy
	// cancelShipping gives schedule_shipping a compensation
	// (shipping.cancel.v1); without it the step declares NoCompensation.
	cancelShipping bool
}

func (o defOpts) timeout(step string) time.Duration {
	if d, ok := o.timeouts[step]; ok {
		return d
	}
	return 30 * time.Second
}

func (o defOpts) compTimeout(step string) time.Duration {
	if d, ok := o.compTimeouts[step]; ok {
		return d
	}
	return 30 * time.Second
}

// ordersDef is the example saga: reserve inventory, charge payment,
// schedule shipping; compensations release and refund (and cancel the
// shipment with defOpts.cancelShipping).
func ordersDef(t *testing.T, tp topics, o defOpts) *saga.Definition[Order] {
	t.Helper()
	if o.retry.MaxAttempts == 0 {
		o.retry = retry.Policy{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond, MaxAttempts: 5, Jitter: retry.JitterNone}
	}
	ship := saga.Step[Order]{
		Name: "schedule_shipping",
		Command: func(o Order) (saga.Command, error) {
			return saga.Command{Topic: tp.shipping, Type: "shipping.schedule.v1", Payload: o}, nil
		},
		Timeout: o.timeout("schedule_shipping"), CompensationTimeout: o.compTimeout("schedule_shipping"), Retry: o.retry,
		NoCompensation: true,
	}
	if o.cancelShipping {
		ship.NoCompensation = false
		ship.Compensation = func(o Order) (saga.Command, error) {
			return saga.Command{Topic: tp.shipping, Type: "shipping.cancel.v1", Payload: o}, nil
		}
	}
	def, err := saga.Define("orders",
		saga.Step[Order]{
			Name: "reserve_inventory",
			Command: func(o Order) (saga.Command, error) {
				return saga.Command{Topic: tp.inventory, Type: "inventory.reserve.v1", Payload: o}, nil
			},
			OnSuccess: func(o *Order, r saga.Reply) error {
				var body struct{ ID string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.ReservationID = body.ID
				return nil
			},
			Compensation: func(o Order) (saga.Command, error) {
				return saga.Command{Topic: tp.inventory, Type: "inventory.release.v1", Payload: map[string]string{"reservation": o.ReservationID}}, nil
			},
			Timeout: o.timeout("reserve_inventory"), CompensationTimeout: o.compTimeout("reserve_inventory"), Retry: o.retry,
		},
		saga.Step[Order]{
			Name: "charge_payment",
			Command: func(o Order) (saga.Command, error) {
				if o.Amount < 0 {
					return saga.Command{}, fmt.Errorf("negative amount %d", o.Amount)
				}
				return saga.Command{Topic: tp.payment, Type: "payment.charge.v1", Payload: o}, nil
			},
			OnSuccess: func(o *Order, r saga.Reply) error {
				var body struct{ ID string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.PaymentID = body.ID
				return nil
			},
			Compensation: func(o Order) (saga.Command, error) {
				return saga.Command{Topic: tp.payment, Type: "payment.refund.v1", Payload: o}, nil
			},
			Timeout: o.timeout("charge_payment"), CompensationTimeout: o.compTimeout("charge_payment"), Retry: o.retry,
		},
		ship,
	)
	require.NoError(t, err)
	return def
}

// action is what a participant does with a command.
type action int

const (
	succeed action = iota
	fail
	ignore // never reply (the step times out)
	// hold keeps the command unanswered until release: the participant is
	// down, and works through its backlog when it is back.
	hold
)

// participants are the in-process services answering the saga's commands.
// decide picks each reply; log records every command once, in arrival
// order, as "step/phase/attempt". Each step has an effect, idempotent by
// business state like a real participant's: a successful forward command
// puts it in place, a successful compensation removes it if it is there
// (and finds nothing to undo otherwise).
type participants struct {
	mu     sync.Mutex
	log    map[string][]string // by saga id
	seen   map[string]bool     // event ids: participants are idempotent
	cmds   map[string]*message.Message
	held   map[string][]*message.Message // by "id/step/phase", in arrival order
	decide func(sagaID, step, phase string, attempt int) action
	// before, when set, runs before each reply is sent (outside the lock).
	before func(sagaID, step, phase string)
	pub    message.Publisher
	// pgx, when set, is where participants write: each reply goes to the
	// outbox (saga.ReplyEvent, outbox.Add) in a pgx.Tx that also records
	// the effect in participant_effects, instead of being published.
	pgx *pgxpool.Pool
	// by "id/step": the effect is in place; how often it was applied, and
	// how often a compensation removed it.
	inPlace         map[string]bool
	applied, undone map[string]int
}

func newParticipants(pub message.Publisher) *participants {
	return &participants{
		log: map[string][]string{}, seen: map[string]bool{}, cmds: map[string]*message.Message{},
		held:    map[string][]*message.Message{},
		inPlace: map[string]bool{}, applied: map[string]int{}, undone: map[string]int{},
		decide: func(string, string, string, int) action { return succeed },
		pub:    pub,
	}
}

// effect reports saga id's step's effect: in place now, how often applied
// and how often undone.
func (p *participants) effect(id, step string) (inPlace bool, applied, undone int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := id + "/" + step
	return p.inPlace[k], p.applied[k], p.undone[k]
}

// heldCount is the number of held commands of saga id's step and phase.
func (p *participants) heldCount(id, step, phase string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.held[id+"/"+step+"/"+phase])
}

// release answers the held commands of saga id's step and phase, in
// arrival order, with act: the participant is back and works through its
// backlog. It returns how many it answered.
func (p *participants) release(id, step, phase string, act action) (int, error) {
	p.mu.Lock()
	k := id + "/" + step + "/" + phase
	msgs := p.held[k]
	delete(p.held, k)
	p.mu.Unlock()
	for _, m := range msgs {
		if err := p.answer(m, act); err != nil {
			return 0, err
		}
	}
	return len(msgs), nil
}

func (p *participants) setDecide(f func(sagaID, step, phase string, attempt int) action) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.decide = f
}

func (p *participants) commands(sagaID string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.log[sagaID]...)
}

// command returns the first command received for the step and phase.
func (p *participants) command(sagaID, step, phase string) *message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmds[sagaID+"/"+step+"/"+phase]
}

func (p *participants) handle(msg *message.Message) error {
	md := msg.Metadata
	id, step, phase, attempt := md.Get(metadata.SagaID), md.Get(metadata.SagaStep), md.Get(metadata.SagaPhase), md.Get(metadata.SagaAttempt)
	var n int
	_, _ = fmt.Sscan(attempt, &n)
	p.mu.Lock()
	if p.seen[md.Get(metadata.EventID)] {
		p.mu.Unlock()
		return nil
	}
	p.seen[md.Get(metadata.EventID)] = true
	entry := step + "/" + phase + "/" + attempt
	p.log[id] = append(p.log[id], entry)
	if _, ok := p.cmds[id+"/"+step+"/"+phase]; !ok {
		p.cmds[id+"/"+step+"/"+phase] = msg.Copy()
	}
	act := p.decide(id, step, phase, n)
	if act == hold {
		k := id + "/" + step + "/" + phase
		p.held[k] = append(p.held[k], msg.Copy())
		p.mu.Unlock()
		return nil
	}
	before := p.before
	p.mu.Unlock()
	if before != nil {
		before(id, step, phase)
	}
	return p.answer(msg, act)
}

// answer applies command msg's effect as act says, then sends the reply.
func (p *participants) answer(msg *message.Message, act action) error {
	md := msg.Metadata
	id, step, phase := md.Get(metadata.SagaID), md.Get(metadata.SagaStep), md.Get(metadata.SagaPhase)
	if act == succeed {
		k := id + "/" + step
		p.mu.Lock()
		switch {
		case phase == saga.PhaseForward && !p.inPlace[k]:
			p.inPlace[k] = true
			p.applied[k]++
		case phase == saga.PhaseCompensation && p.inPlace[k]:
			p.inPlace[k] = false
			p.undone[k]++
		}
		p.mu.Unlock()
	}
	var typ string
	switch {
	case act == ignore:
		return nil
	case phase == saga.PhaseForward && act == succeed:
		typ = step + ".succeeded"
	case phase == saga.PhaseForward:
		typ = step + ".failed"
	case act == succeed:
		typ = step + ".compensated"
	default:
		typ = step + ".compensation_failed"
	}
	if p.pgx != nil {
		return p.answerInPgxTx(msg, typ, act)
	}
	reply, err := saga.NewReply(msg, typ, map[string]string{"ID": step + "-" + id})
	if err != nil {
		return err
	}
	if act == fail {
		reply.Metadata.Set(metadata.SagaError, step+" "+phase+" refused")
	}
	return p.pub.Publish(saga.ReplyTopic(msg), reply)
}

// answerInPgxTx is a participant on pgx: its effect (a row) and its reply
// (an outbox event) commit in one pgx.Tx, and the relay publishes the
// reply.
func (p *participants) answerInPgxTx(msg *message.Message, typ string, act action) error {
	md := msg.Metadata
	id, step, phase := md.Get(metadata.SagaID), md.Get(metadata.SagaStep), md.Get(metadata.SagaPhase)
	ctx := msg.Context()
	tx, err := p.pgx.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `INSERT INTO participant_effects (event_id, saga_id, step, phase, reply) VALUES ($1, $2, $3, $4, $5)`,
		md.Get(metadata.EventID), id, step, phase, typ); err != nil {
		return err
	}
	ev, err := saga.ReplyEvent(msg, typ, map[string]string{"ID": step + "-" + id})
	if err != nil {
		return err
	}
	if act == fail {
		ev.Metadata[metadata.SagaError] = step + " " + phase + " refused"
	}
	if err := outbox.Add(ctx, postgres.PgxTx(tx), ev); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// effects counts saga id's participant_effects rows (pgx participants).
func (b *bundle) effects(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pgx.QueryRow(context.Background(), `SELECT count(*) FROM participant_effects WHERE saga_id = $1`, id).Scan(&n))
	return n
}

// bundle is what a saga test needs.
type bundle struct {
	schema *pgtest.Schema
	tr     *transport.Transport
	tp     topics
	def    *saga.Definition[Order]
	parts  *participants
	store  *idempotency.PostgresStore
	// replyMiddleware, when set, runs inside the idempotency middleware
	// of orchestrators started afterwards.
	replyMiddleware message.HandlerMiddleware
	// tracerProvider, when set, is the TracerProvider of orchestrators
	// started afterwards.
	tracerProvider trace.TracerProvider
	// replyShards is the Config.ReplyShards of orchestrators started
	// afterwards (0: the default, one reply topic).
	replyShards int
	// driver is pgtest.DriverPQ or pgtest.DriverPgx: with pgx the
	// orchestrators run on pgx (a *pgxpool.Pool), sagas start in a pgx.Tx,
	// participants answer from a pgx.Tx, and the tests read through pgx.
	driver string
	pgx    *pgxpool.Pool
}

// handle is the pool the tests read sagas through: the pgx pool on pgx,
// else the *sql.DB.
func (b *bundle) handle() postgres.Handle {
	if b.pgx != nil {
		return postgres.From(b.pgx)
	}
	return postgres.From(b.schema.DB)
}

// resolve is saga.Resolve on the bundle's driver.
func (b *bundle) resolve(ctx context.Context, id string, action saga.ResolveAction, note string, dryRun bool) (saga.Resolution, error) {
	if b.pgx != nil {
		return saga.Resolve(ctx, postgres.From(b.pgx), id, action, note, dryRun)
	}
	return saga.Resolve(ctx, postgres.From(b.schema.DB), id, action, note, dryRun)
}

// setup opens a schema, a transport (gochannel by default), starts an
// outbox relay and a router with the participants. Orchestrators are added
// with startOrchestrator.
func setup(t *testing.T, tcfg *transport.Config, o defOpts) *bundle {
	t.Helper()
	return setupTopics(t, tcfg, o, newTopics())
}

// setupDriver is setup on driver (pgtest.DriverPQ or pgtest.DriverPgx).
func setupDriver(t *testing.T, driver string, o defOpts) *bundle {
	t.Helper()
	return setupOn(t, nil, o, newTopics(), driver)
}

// setupTopics is setup with the given topic names.
func setupTopics(t *testing.T, tcfg *transport.Config, o defOpts, tp topics) *bundle {
	t.Helper()
	return setupOn(t, tcfg, o, tp, pgtest.DriverPQ)
}

func setupOn(t *testing.T, tcfg *transport.Config, o defOpts, tp topics, driver string) *bundle {
	t.Helper()
	b := &bundle{tp: tp, driver: driver}
	b.schema = pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	// On pq everything runs on the pool postgres.Open gives users; pgtest's
	// own lib/pq pool, left unused, closes after it.
	db, err := postgres.Open(b.schema.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	b.schema.DB = db
	b.schema.DB.SetMaxOpenConns(8)
	cfg := transport.Config{Kind: transport.GoChannel}
	if tcfg != nil {
		cfg = *tcfg
	}
	if cfg.Kind == transport.SQL && cfg.SQL.DB == nil {
		cfg.SQL.DB = b.schema.DB
	}
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	b.tr = tr
	t.Cleanup(func() { _ = tr.Close() })
	b.def = ordersDef(t, b.tp, o)
	relayCfg := relay.Config{PollInterval: 20 * time.Millisecond, ListenURL: b.schema.URL, BatchSize: 100}
	var rel *relay.Relay
	if driver == pgtest.DriverPgx {
		// The reply consumers' idempotency middleware then hands
		// HandleReply a pgx.Tx (idempotency.PgxTxFromContext).
		b.pgx = b.schema.Pgx(t)
		b.store, err = idempotency.NewPostgresStore(postgres.From(b.pgx))
		require.NoError(t, err)
		rel, err = relay.New(postgres.From(b.pgx), tr.Publisher(), relayCfg)
	} else {
		b.store, err = idempotency.NewPostgresStore(postgres.From(b.schema.DB))
		require.NoError(t, err)
		rel, err = relay.New(postgres.From(b.schema.DB), tr.Publisher(), relayCfg)
	}
	require.NoError(t, err)
	runBackground(t, "relay", rel.Run, rel.Close)

	b.parts = newParticipants(tr.Publisher())
	if driver == pgtest.DriverPgx {
		_, err := b.pgx.Exec(context.Background(), `CREATE TABLE participant_effects (event_id text PRIMARY KEY, saga_id text NOT NULL,
			step text NOT NULL, phase text NOT NULL, reply text NOT NULL)`)
		require.NoError(t, err)
		b.parts.pgx = b.pgx
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	for _, topic := range []string{b.tp.inventory, b.tp.payment, b.tp.shipping} {
		sub, err := tr.Subscriber("participant_" + topic)
		require.NoError(t, err)
		initTopic(t, sub, topic)
		router.AddConsumerHandler("participant_"+topic, topic, sub, b.parts.handle)
	}
	runRouter(t, router)
	return b
}

func initTopic(t *testing.T, sub message.Subscriber, topic string) {
	if init, ok := sub.(message.SubscribeInitializer); ok {
		require.NoError(t, init.SubscribeInitialize(topic))
	}
}

// runRouter runs r until the test ends and waits for it to be running.
func runRouter(t *testing.T, r *message.Router) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	t.Cleanup(stop)
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start in 30s")
	}
	return stop
}

// runBackground runs a Run/Close component until the test ends.
func runBackground(t *testing.T, what string, run func(context.Context) error, closeFn func() error) (stop func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- run(context.Background()) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = closeFn()
			if err := <-done; err != nil {
				t.Errorf("%s: Run: %v", what, err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// orch is one orchestrator instance with its reply router and timeout loop.
type orch struct {
	o    *saga.Orchestrator[Order]
	reg  *prometheus.Registry
	logs *syncLogger
	stop func()
}

// startOrchestrator starts an orchestrator instance: a reply consumer
// behind the idempotency middleware and the timeout loop.
func (b *bundle) startOrchestrator(t *testing.T) *orch {
	t.Helper()
	reg := prometheus.NewRegistry()
	logs := newSyncLogger()
	cfg := saga.Config{
		ReplyTopic: b.tp.replies, PollInterval: 20 * time.Millisecond, Registerer: reg, Logger: logs,
		TracerProvider: b.tracerProvider, ReplyShards: b.replyShards,
	}
	var o *saga.Orchestrator[Order]
	var err error
	if b.pgx != nil {
		o, err = saga.NewOrchestrator(postgres.From(b.pgx), b.def, cfg)
	} else {
		o, err = saga.NewOrchestrator(postgres.From(b.schema.DB), b.def, cfg)
	}
	require.NoError(t, err)
	dedup, err := idempotency.NewMiddleware(b.store, idempotency.Config{Consumer: "orders-saga", Registerer: reg})
	require.NoError(t, err)
	sub, err := b.tr.Subscriber("orders_saga")
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	for i, topic := range o.ReplyTopics() {
		initTopic(t, sub, topic)
		h := router.AddConsumerHandler(fmt.Sprintf("orders-saga-%d", i), topic, sub, o.HandleReply)
		if b.pgx == nil {
			// On pgx the orchestrator applies each reply in a pgx.Tx of
			// its own (the idempotency middleware's transaction is a
			// *sql.Tx here).
			h.AddMiddleware(dedup.Middleware)
		}
		if b.replyMiddleware != nil {
			h.AddMiddleware(b.replyMiddleware)
		}
	}
	stopRouter := runRouter(t, router)
	stopLoop := runBackground(t, "orchestrator", o.Run, o.Close)
	return &orch{o: o, reg: reg, logs: logs, stop: func() { stopLoop(); stopRouter() }}
}

// start starts a saga in its own transaction.
func (b *bundle) start(t *testing.T, o *orch, id string) {
	t.Helper()
	ctx := context.Background()
	if b.pgx != nil {
		tx, err := b.pgx.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, o.o.Start(ctx, postgres.PgxTx(tx), id, Order{ID: id, Amount: 42}))
		require.NoError(t, tx.Commit(ctx))
		return
	}
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, o.o.Start(ctx, postgres.SQLTx(tx), id, Order{ID: id, Amount: 42}))
	require.NoError(t, tx.Commit())
}

// waitState polls until saga id is in state, or fails the test naming
// the state, history and commands it reached.
func (b *bundle) waitState(t *testing.T, id string, want saga.State) saga.Info {
	t.Helper()
	var last saga.Info
	poll.Until(t, 30*time.Second, func() bool {
		info, _, err := saga.Get(context.Background(), b.handle(), id)
		if err == nil {
			last = info
		}
		return err == nil && info.State == want
	}, "saga %s: want state %s, still %v", id, want, later(func() string {
		h, _ := saga.History(context.Background(), b.handle(), id)
		return fmt.Sprintf("%s (last error %q); history %+v; commands %v", last.State, last.LastError, h, b.parts.commands(id))
	}))
	return last
}

// waitHistory polls until saga id's history has an entry of kind.
func (b *bundle) waitHistory(t *testing.T, id, kind string) []saga.HistoryEntry {
	t.Helper()
	var h []saga.HistoryEntry
	poll.Until(t, 30*time.Second, func() bool {
		var err error
		h, err = saga.History(context.Background(), b.handle(), id)
		require.NoError(t, err)
		return slices.ContainsFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == kind })
	}, "saga %s: no %s entry in history", id, kind)
	return h
}

// waitCommand waits until a participant received the command
// "step/phase/attempt" of saga id.
func (b *bundle) waitCommand(t *testing.T, id, entry string) {
	t.Helper()
	poll.Until(t, 30*time.Second, func() bool { return slices.Contains(b.parts.commands(id), entry) },
		"saga %s: command %s not received; got %v", id, entry, later(func() string { return fmt.Sprint(b.parts.commands(id)) }))
}

// later is a failure message part computed when the message is printed
// (poll.Until evaluates its arguments when called).
type later func() string

func (f later) String() string { return f() }

func historyKinds(h []saga.HistoryEntry) []string {
	out := make([]string, len(h))
	for i, e := range h {
		out[i] = e.Step + ":" + e.Kind
	}
	return out
}

func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if matches(m, labels) {
				if c := m.GetCounter(); c != nil {
					return c.GetValue()
				}
				if g := m.GetGauge(); g != nil {
					return g.GetValue()
				}
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return 0
}

func matches(m *dto.Metric, labels map[string]string) bool {
	n := 0
	for _, lp := range m.GetLabel() {
		if v, ok := labels[lp.GetName()]; ok {
			if v != lp.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(labels)
}

// syncLogger captures log lines like watermill's CaptureLoggerAdapter, whose
// Captured hands out its live map: a test reading it while the orchestrator
// logs is a data race. errorsLogged copies under the lock.
type syncLogger struct {
	s      *logStore
	fields watermill.LogFields
}

type logStore struct {
	mu   sync.Mutex
	msgs []watermill.CapturedMessage
}

func newSyncLogger() *syncLogger { return &syncLogger{s: &logStore{}} }

func (l *syncLogger) log(level watermill.LogLevel, msg string, err error, fields watermill.LogFields) {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	l.s.msgs = append(l.s.msgs, watermill.CapturedMessage{Level: level, Time: time.Now(), Fields: l.fields.Add(fields), Msg: msg, Err: err})
}

func (l *syncLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.log(watermill.ErrorLogLevel, msg, err, fields)
}
func (l *syncLogger) Info(msg string, fields watermill.LogFields) {
	l.log(watermill.InfoLogLevel, msg, nil, fields)
}
func (l *syncLogger) Debug(msg string, fields watermill.LogFields) {
	l.log(watermill.DebugLogLevel, msg, nil, fields)
}
func (l *syncLogger) Trace(msg string, fields watermill.LogFields) {
	l.log(watermill.TraceLogLevel, msg, nil, fields)
}
func (l *syncLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &syncLogger{s: l.s, fields: l.fields.Add(fields)}
}

// errorsLogged returns a copy of the error lines so far.
func (l *syncLogger) errorsLogged() []watermill.CapturedMessage {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	var out []watermill.CapturedMessage
	for _, m := range l.s.msgs {
		if m.Level == watermill.ErrorLogLevel {
			out = append(out, m)
		}
	}
	return out
}

// waitErrorsLogged waits (bounded) until ok holds for the error lines, and
// returns them: an orchestrator may log a transition after the state it
// wrote is visible.
func (l *syncLogger) waitErrorsLogged(t *testing.T, what string, ok func([]watermill.CapturedMessage) bool) []watermill.CapturedMessage {
	t.Helper()
	var got []watermill.CapturedMessage
	poll.Until(t, 30*time.Second, func() bool { got = l.errorsLogged(); return ok(got) },
		"%s: not logged within 10s; error lines: %+v", what, &got)
	return got
}
