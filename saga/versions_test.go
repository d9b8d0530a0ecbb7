package saga_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// Versions against real Postgres and gochannel: instances of version 1
// left mid-flight end by version 1's steps under an orchestrator whose
// definition is version 2; a step inserted under an unchanged version is
// refused, naming the step; a declared migration does what its dry run
// says, instance by instance. Commands are counted from the participants'
// side.

// ordersV2 is version 2 of the orders saga: fraud_check inserted before
// charge_payment (with a compensation, fraud.clear.v1, when fraudComp).
// With version 1 it is version 1 with that step inserted: a changed
// definition under an unchanged version.
func ordersV2(t *testing.T, b *bundle, version int, fraudComp bool) *saga.Definition[Order] {
	t.Helper()
	cmd := func(topic, typ string) func(Order) (saga.Command, error) {
		return func(o Order) (saga.Command, error) { return saga.Command{Topic: topic, Type: typ, Payload: o}, nil }
	}
	fraud := saga.Step[Order]{Name: "fraud_check", Command: cmd(b.tp.payment, "fraud.check.v1"), Timeout: 30 * time.Second, NoCompensation: true}
	if fraudComp {
		fraud.NoCompensation, fraud.Compensation = false, cmd(b.tp.payment, "fraud.clear.v1")
	}
	def, err := saga.DefineVersion("orders", version,
		saga.Step[Order]{Name: "reserve_inventory", Command: cmd(b.tp.inventory, "inventory.reserve.v1"),
			Compensation: cmd(b.tp.inventory, "inventory.release.v1"), Timeout: 30 * time.Second},
		fraud,
		saga.Step[Order]{Name: "charge_payment", Command: cmd(b.tp.payment, "payment.charge.v1"),
			Compensation: cmd(b.tp.payment, "payment.refund.v1"), Timeout: 30 * time.Second},
		saga.Step[Order]{Name: "schedule_shipping", Command: cmd(b.tp.shipping, "shipping.schedule.v1"), NoCompensation: true, Timeout: 30 * time.Second},
	)
	require.NoError(t, err)
	return def
}

// startVersioned is startOrchestrator with def and cfg changed by with.
func (b *bundle) startVersioned(t *testing.T, def *saga.Definition[Order], with func(*saga.Config)) *orch {
	t.Helper()
	reg := prometheus.NewRegistry()
	logs := newSyncLogger()
	cfg := saga.Config{ReplyTopic: b.tp.replies, PollInterval: 20 * time.Millisecond, Registerer: reg, Logger: logs}
	if with != nil {
		with(&cfg)
	}
	o, err := saga.NewOrchestrator(postgres.From(b.schema.DB), def, cfg)
	require.NoError(t, err)
	dedup, err := idempotency.NewMiddleware(b.store, idempotency.Config{Consumer: "orders-saga", Registerer: reg})
	require.NoError(t, err)
	sub, err := b.tr.Subscriber("orders_saga")
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	initTopic(t, sub, o.ReplyTopic())
	router.AddConsumerHandler("orders-saga", o.ReplyTopic(), sub, o.HandleReply).AddMiddleware(dedup.Middleware)
	stopRouter := runRouter(t, router)
	stopLoop := runBackground(t, "orchestrator", o.Run, o.Close)
	return &orch{o: o, reg: reg, logs: logs, stop: func() { stopLoop(); stopRouter() }}
}

// startWith starts saga id with data on o.
func (b *bundle) startWith(t *testing.T, o *orch, id string, data Order) {
	t.Helper()
	require.NoError(t, o.o.StartOutsideTx(context.Background(), postgres.From(b.schema.DB), id, data))
}

// waitHeld waits until the participant holds saga id's command of step
// and phase.
func (b *bundle) waitHeld(t *testing.T, id, step, phase string) {
	t.Helper()
	poll.Until(t, 30*time.Second, func() bool { return b.parts.heldCount(id, step, phase) == 1 },
		"saga %s: %s %s command not held; commands %v", id, step, phase, later(func() string { return fmt.Sprint(b.parts.commands(id)) }))
}

func (b *bundle) release(t *testing.T, id, step, phase string) {
	t.Helper()
	n, err := b.parts.release(id, step, phase, succeed)
	require.NoError(t, err)
	require.Equal(t, 1, n, "saga %s: one %s %s command held", id, step, phase)
}

// heldBy is the participants' script of the version tests, by saga id
// prefix: wait- holds charge_payment's command (the saga waits for its
// reply), ship- holds schedule_shipping's, comp- fails charge_payment and
// holds reserve_inventory's compensation (the saga is compensating).
func heldBy(id, step, phase string, _ int) action {
	switch {
	case strings.HasPrefix(id, "wait-") && step == "charge_payment" && phase == saga.PhaseForward:
		return hold
	case strings.HasPrefix(id, "ship-") && step == "schedule_shipping" && phase == saga.PhaseForward:
		return hold
	case strings.HasPrefix(id, "comp-") && step == "charge_payment" && phase == saga.PhaseForward:
		return fail
	case strings.HasPrefix(id, "comp-") && step == "reserve_inventory" && phase == saga.PhaseCompensation:
		return hold
	}
	return succeed
}

// leaveMidFlight starts the v1 instances on o and waits until each is
// held where heldBy says.
func (b *bundle) leaveMidFlight(t *testing.T, o *orch, ids ...string) {
	t.Helper()
	for _, id := range ids {
		data := Order{ID: id, Amount: 42}
		if strings.Contains(id, "big") {
			data.Amount = 500
		}
		b.startWith(t, o, id, data)
	}
	for _, id := range ids {
		switch {
		case strings.HasPrefix(id, "wait-"):
			b.waitHeld(t, id, "charge_payment", saga.PhaseForward)
		case strings.HasPrefix(id, "ship-"):
			b.waitHeld(t, id, "schedule_shipping", saga.PhaseForward)
		case strings.HasPrefix(id, "comp-"):
			b.waitHeld(t, id, "reserve_inventory", saga.PhaseCompensation)
		}
	}
}

func TestVersionsOldInstancesEndByTheirOwnSteps(t *testing.T) {
	t.Parallel()
	// Version 1's schedule_shipping times out after 3s: the ship- sagas'
	// timeouts fire under the version 2 orchestrator (RunOnce).
	b := setup(t, nil, defOpts{timeouts: map[string]time.Duration{"schedule_shipping": 3 * time.Second}})
	b.parts.setDecide(heldBy)
	o1 := b.startOrchestrator(t)
	v1 := []string{"wait-1", "wait-2", "ship-1", "ship-2", "comp-1", "comp-2"}
	b.leaveMidFlight(t, o1, v1...)
	o1.stop() // killed mid-flight

	// Version 2 inserts fraud_check, with a compensation: had a version 1
	// instance been decided by version 2, some participant would see a
	// fraud_check command.
	v2 := ordersV2(t, b, 2, true)
	require.NotEqual(t, b.def.Fingerprint(), v2.Fingerprint())
	o2 := b.startVersioned(t, v2, func(c *saga.Config) { c.Versions = []saga.Versioned{b.def} })
	<-o2.o.Running()
	for _, id := range []string{"wait-1", "wait-2"} {
		b.release(t, id, "charge_payment", saga.PhaseForward)
	}
	for _, id := range []string{"comp-1", "comp-2"} {
		b.release(t, id, "reserve_inventory", saga.PhaseCompensation)
	}
	b.startWith(t, o2, "v2-1", Order{ID: "v2-1", Amount: 42})

	want := map[string][]string{
		"wait-": {"reserve_inventory/forward/1", "charge_payment/forward/1", "schedule_shipping/forward/1"},
		"ship-": {"reserve_inventory/forward/1", "charge_payment/forward/1", "schedule_shipping/forward/1",
			"charge_payment/compensation/1", "reserve_inventory/compensation/1"},
		"comp-": {"reserve_inventory/forward/1", "charge_payment/forward/1", "reserve_inventory/compensation/1"},
		"v2-":   {"reserve_inventory/forward/1", "fraud_check/forward/1", "charge_payment/forward/1", "schedule_shipping/forward/1"},
	}
	end := map[string]saga.State{"wait-": saga.StateCompleted, "ship-": saga.StateCompensated, "comp-": saga.StateCompensated, "v2-": saga.StateCompleted}
	for _, id := range append(v1, "v2-1") {
		prefix := id[:strings.Index(id, "-")+1]
		info := b.waitState(t, id, end[prefix])
		require.Equal(t, want[prefix], b.parts.commands(id), "saga %s: the commands of its own version's steps, each once", id)
		version := 1
		if prefix == "v2-" {
			version = 2
		}
		require.Equal(t, version, info.DefinitionVersion, id)
	}

	vs, err := saga.Versions(context.Background(), b.handle())
	require.NoError(t, err)
	require.Len(t, vs, 2)
	require.Equal(t, map[saga.State]int64{saga.StateCompleted: 2, saga.StateCompensated: 4}, vs[0].Counts)
	require.True(t, vs[0].Retired(), "no instance of version 1 is left: it may be unregistered")
	require.Equal(t, []string{b.def.Fingerprint()}, vs[0].Fingerprints, "registered at start-up")
	require.Equal(t, 2, vs[1].Version)
	require.Equal(t, map[saga.State]int64{saga.StateCompleted: 1}, vs[1].Counts)
}

func TestVersionsUnregisteredVersionIsLeftAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	b.parts.setDecide(heldBy)
	o1 := b.startOrchestrator(t)
	b.leaveMidFlight(t, o1, "wait-1")
	o1.stop()
	// Its reply is overdue: a deadline RunOnce would fire.
	_, err := b.schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - interval '1 second' WHERE id = 'wait-1'`)
	require.NoError(t, err)
	before, _, err := saga.Get(context.Background(), b.handle(), "wait-1")
	require.NoError(t, err)

	// Version 2 alone: version 1's instance is not its to decide.
	logs := newSyncLogger()
	o2, err := saga.NewOrchestrator(postgres.From(b.schema.DB), ordersV2(t, b, 2, true), saga.Config{ReplyTopic: b.tp.replies, Logger: logs})
	require.NoError(t, err)
	require.NoError(t, o2.CheckVersions(context.Background()), "other versions' instances are reported, not refused")
	got := logs.errorsLogged()
	require.Len(t, got, 1)
	require.ErrorContains(t, got[0].Err, "1 instance(s) not finished run on definition version 1, which this orchestrator does not run (it runs 2): register version 1's definition in saga.Config.Versions")

	reply, err := saga.NewReply(b.parts.command("wait-1", "charge_payment", saga.PhaseForward), "charge_payment.succeeded", map[string]string{"ID": "p-1"})
	require.NoError(t, err)
	err = o2.HandleReply(reply)
	require.ErrorIs(t, err, saga.ErrVersionNotRegistered)
	require.ErrorContains(t, err, `saga orders "wait-1" runs on definition version 1, which this orchestrator does not run (it runs version(s) 2): the instance is left as it is; register version 1's definition in saga.Config.Versions`)
	n, err := o2.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
	after, _, err := saga.Get(context.Background(), b.handle(), "wait-1")
	require.NoError(t, err)
	require.Equal(t, before, after, "left as it is")
	require.Equal(t, []string{"reserve_inventory/forward/1", "charge_payment/forward/1"}, b.parts.commands("wait-1"))
}

func TestVersionsStepInsertedUnderTheSameVersionIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	b.parts.setDecide(heldBy)
	o1 := b.startOrchestrator(t)
	b.leaveMidFlight(t, o1, "wait-1", "wait-2")
	o1.stop()

	changed := ordersV2(t, b, 1, false) // version 1 with fraud_check inserted
	o, err := saga.NewOrchestrator(postgres.From(b.schema.DB), changed, saga.Config{ReplyTopic: b.tp.replies, PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err = o.Run(ctx)
	require.ErrorIs(t, err, saga.ErrDefinitionChanged)
	require.ErrorContains(t, err, `saga "orders" version 1: step "fraud_check" inserted before "charge_payment" since the 2 running instance(s) started; `+
		`give the changed definition a new version (saga.DefineVersion) and keep version 1 registered in Config.Versions`)
	require.NoError(t, o.Close())
	require.ErrorIs(t, o.StartOutsideTx(context.Background(), postgres.From(b.schema.DB), "new-1", Order{ID: "new-1"}), saga.ErrDefinitionChanged,
		"no new instance on the refused graph")

	// A reply reaching it anyway is not decided by the changed steps.
	reply, err := saga.NewReply(b.parts.command("wait-1", "charge_payment", saga.PhaseForward), "charge_payment.succeeded", map[string]string{"ID": "p-1"})
	require.NoError(t, err)
	require.ErrorIs(t, o.HandleReply(reply), saga.ErrDefinitionChanged)
	info, _, err := saga.Get(context.Background(), b.handle(), "wait-1")
	require.NoError(t, err)
	require.Equal(t, saga.StateRunning, info.State)
	require.Equal(t, 1, info.StepIndex)
}

func TestVersionsMigrationDoesWhatItsDryRunSays(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	_, err := migrate.Up(context.Background(), postgres.From(b.schema.DB), audit.Migrations())
	require.NoError(t, err)
	b.parts.setDecide(heldBy)
	o1 := b.startOrchestrator(t)
	b.leaveMidFlight(t, o1, "wait-1", "wait-2", "wait-big-1", "ship-1", "comp-1")
	o1.stop()

	v2 := ordersV2(t, b, 2, false)
	mig := saga.Migrate(b.def, v2, func(o Order, at saga.Position) (Order, saga.Position, error) {
		if o.Amount > 100 {
			return o, at, errors.New("above the fraud threshold: it must see fraud_check, let it end on version 1")
		}
		return o, at, nil
	})
	o2 := b.startVersioned(t, v2, func(c *saga.Config) {
		c.Versions, c.Migrations = []saga.Versioned{b.def}, []saga.Migration{mig}
	})
	<-o2.o.Running()
	ctx := context.Background()
	plan, err := o2.o.PlanMigration(ctx)
	require.NoError(t, err)
	moves := func(id, step, next string) saga.MigrationPlan {
		return saga.MigrationPlan{SagaID: id, State: saga.StateRunning, FromVersion: 1, FromStep: step, ToVersion: 2, ToStep: step,
			Next: fmt.Sprintf("sends nothing now; waits for the reply to step %q's command already sent, then %s", step, next)}
	}
	want := []saga.MigrationPlan{
		moves("wait-1", "charge_payment", `sends step "schedule_shipping"'s command (version 2)`),
		moves("wait-2", "charge_payment", `sends step "schedule_shipping"'s command (version 2)`),
		{SagaID: "wait-big-1", State: saga.StateRunning, FromVersion: 1, FromStep: "charge_payment",
			Stays: "the migration refused it: above the fraud threshold: it must see fraud_check, let it end on version 1"},
		moves("ship-1", "schedule_shipping", "completes"),
		{SagaID: "comp-1", State: saga.StateCompensating, FromVersion: 1, FromStep: "reserve_inventory",
			Stays: `compensating (step "reserve_inventory"): a migration places only instances running forward; it ends on version 1`},
	}
	require.Equal(t, want, plan, "the dry run")
	for _, id := range []string{"wait-1", "ship-1"} {
		info, _, err := saga.Get(ctx, b.handle(), id)
		require.NoError(t, err)
		require.Equal(t, 1, info.DefinitionVersion, "the dry run wrote nothing")
	}
	entries, err := audit.List(ctx, postgres.From(b.schema.DB), 0)
	require.NoError(t, err)
	require.Empty(t, entries)

	rep, err := o2.o.Migrate(ctx, audit.Operator{User: "alice", Host: "console"})
	require.NoError(t, err)
	require.Equal(t, plan, rep.Plans, "the migration does what the dry run showed, instance by instance")
	require.Equal(t, 3, rep.Moved)
	require.Equal(t, 2, rep.Stayed)
	entries, err = audit.List(ctx, postgres.From(b.schema.DB), 0)
	require.NoError(t, err)
	require.Len(t, entries, 3, "one audit row per instance moved")
	var audited []string
	for _, e := range entries {
		require.Equal(t, "saga migrate", e.Command)
		require.Equal(t, "alice", e.User)
		audited = append(audited, e.Args[0])
	}
	slices.Sort(audited)
	require.Equal(t, []string{"ship-1", "wait-1", "wait-2"}, audited)
	// The reviewed plan applied again: every instance it moves has moved
	// on (to version 2); the re-check under the lock leaves them be.
	again, err := o2.o.ApplyMigration(ctx, audit.Operator{User: "alice"}, plan)
	require.NoError(t, err)
	require.Zero(t, again.Moved)
	for i, p := range again.Plans {
		if plan[i].Moves() {
			require.Contains(t, p.Stays, "it moved on since the plan (now running, version 2", p.SagaID)
			require.Zero(t, p.ToVersion)
		} else {
			require.Equal(t, plan[i], p)
		}
	}
	entries, err = audit.List(ctx, postgres.From(b.schema.DB), 0)
	require.NoError(t, err)
	require.Len(t, entries, 3, "nothing written again")
	for _, p := range plan {
		info, h, err := saga.Get(ctx, b.handle(), p.SagaID)
		require.NoError(t, err)
		migrated := slices.ContainsFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindMigrated })
		if p.Moves() {
			require.Equal(t, 2, info.DefinitionVersion, p.SagaID)
			require.True(t, migrated, p.SagaID)
		} else {
			require.Equal(t, 1, info.DefinitionVersion, p.SagaID)
			require.False(t, migrated, p.SagaID)
		}
	}

	// The replies in flight arrive: each instance goes on by the version
	// it is on now.
	for _, id := range []string{"wait-1", "wait-2", "wait-big-1"} {
		b.release(t, id, "charge_payment", saga.PhaseForward)
	}
	b.release(t, "ship-1", "schedule_shipping", saga.PhaseForward)
	b.release(t, "comp-1", "reserve_inventory", saga.PhaseCompensation)
	for _, id := range []string{"wait-1", "wait-2", "wait-big-1", "ship-1"} {
		b.waitState(t, id, saga.StateCompleted)
		require.Equal(t, []string{"reserve_inventory/forward/1", "charge_payment/forward/1", "schedule_shipping/forward/1"}, b.parts.commands(id), id)
	}
	b.waitState(t, "comp-1", saga.StateCompensated)
	require.Equal(t, []string{"reserve_inventory/forward/1", "charge_payment/forward/1", "reserve_inventory/compensation/1"}, b.parts.commands("comp-1"))

	plan, err = o2.o.PlanMigration(ctx)
	require.NoError(t, err)
	require.Empty(t, plan, "no live instance of version 1 is left")
}
