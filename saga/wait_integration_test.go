package saga_test

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

// Waiting and Retriable steps against real Postgres and gochannel: the
// participants are the bundle's (helpers_test.go), which count each
// step's effect.

// approvalDef is reserve_inventory (released on compensation), approval
// (waits up to wait for approval.granted, whose Amount replaces the
// order's), charge_payment (refunded on compensation).
func approvalDef(t *testing.T, tp topics, wait time.Duration) *saga.Definition[Order] {
	t.Helper()
	cmd := func(topic, typ string) func(Order) (saga.Command, error) {
		return func(o Order) (saga.Command, error) { return saga.Command{Topic: topic, Type: typ, Payload: o}, nil }
	}
	return saga.MustDefine("orders",
		saga.Step[Order]{Name: "reserve_inventory", Command: cmd(tp.inventory, "inventory.reserve.v1"),
			Compensation: cmd(tp.inventory, "inventory.release.v1"), Timeout: 30 * time.Second},
		saga.Step[Order]{Name: "approval", WaitFor: "approval.granted", Timeout: wait,
			OnSuccess: func(o *Order, r saga.Reply) error {
				var body struct{ Amount int }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.Amount = body.Amount
				return nil
			}},
		saga.Step[Order]{Name: "charge_payment", Command: cmd(tp.payment, "payment.charge.v1"),
			Compensation: cmd(tp.payment, "payment.refund.v1"), Timeout: 30 * time.Second},
	)
}

// sendEvent writes saga id's event through the outbox (SignalEvent), for
// the relay to publish on the reply topic.
func (b *bundle) sendEvent(t *testing.T, o *orch, id, eventType string, payload any) {
	t.Helper()
	ev, err := o.o.SignalEvent(id, eventType, payload)
	require.NoError(t, err)
	db := postgres.From(b.schema.DB)
	if b.pgx != nil {
		db = postgres.From(b.pgx)
	}
	require.NoError(t, db.InTx(context.Background(), func(tx postgres.Tx) error {
		return outbox.Add(context.Background(), tx, ev)
	}))
}

// signal calls Signal in a transaction of its own, committed if commit.
func (b *bundle) signal(t *testing.T, o *orch, id, eventType string, payload any, commit bool) error {
	t.Helper()
	ctx := context.Background()
	if b.pgx != nil {
		tx, err := b.pgx.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		if err := o.o.Signal(ctx, postgres.PgxTx(tx), id, eventType, payload); err != nil {
			return err
		}
		if commit {
			require.NoError(t, tx.Commit(ctx))
		}
		return nil
	}
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	if err := o.o.Signal(ctx, postgres.SQLTx(tx), id, eventType, payload); err != nil {
		return err
	}
	if commit {
		require.NoError(t, tx.Commit())
	}
	return nil
}

func (b *bundle) info(t *testing.T, id string) (saga.Info, []string) {
	t.Helper()
	info, h, err := saga.Get(context.Background(), b.handle(), id)
	require.NoError(t, err)
	return info, historyKinds(h)
}

// The event arrives before the timeout, by Signal in the caller's
// transaction (rolled back: not applied; committed: applied) and through
// the transport: the saga continues with the event's payload. On both
// drivers.
func TestWaitingStepEventBeforeTimeoutContinues(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testWaitingStepEventBeforeTimeoutContinues(t, setupDriver(t, driver, defOpts{}))
	})
}

func testWaitingStepEventBeforeTimeoutContinues(t *testing.T, b *bundle) {
	b.def = approvalDef(t, b.tp, time.Minute)
	o := b.startOrchestrator(t)
	for _, id := range []string{"w-signal", "w-event"} {
		b.start(t, o, id)
		b.waitHistory(t, id, saga.KindWait)
	}
	info, h := b.info(t, "w-signal")
	require.Equal(t, saga.StateRunning, info.State)
	require.Equal(t, "approval", info.Step, "the waiting step is the current one")
	require.False(t, info.Deadline.IsZero())

	// Rolled back: nothing happened.
	require.NoError(t, b.signal(t, o, "w-signal", "approval.granted", map[string]int{"Amount": 40}, false))
	info, h2 := b.info(t, "w-signal")
	require.Equal(t, saga.StateRunning, info.State)
	require.Equal(t, "approval", info.Step)
	require.Equal(t, h, h2, "a rolled-back Signal writes nothing")
	require.NotContains(t, b.parts.commands("w-signal"), "charge_payment/forward/1")

	// Committed: the saga goes on.
	require.NoError(t, b.signal(t, o, "w-signal", "approval.granted", map[string]int{"Amount": 40}, true))
	info = b.waitState(t, "w-signal", saga.StateCompleted)
	require.JSONEq(t, `{"id":"w-signal","amount":40}`, withoutPayment(t, info.Data), "OnSuccess read the event")
	_, applied, _ := b.parts.effect("w-signal", "charge_payment")
	require.Equal(t, 1, applied)
	_, kinds := b.info(t, "w-signal")
	require.Equal(t, []string{"reserve_inventory:command", "reserve_inventory:reply", "approval:wait", "approval:reply",
		"charge_payment:command", "charge_payment:reply", "charge_payment:completed"}, kinds)

	// Through the transport.
	b.sendEvent(t, o, "w-event", "approval.granted", map[string]int{"Amount": 41})
	info = b.waitState(t, "w-event", saga.StateCompleted)
	require.JSONEq(t, `{"id":"w-event","amount":41}`, withoutPayment(t, info.Data))

	// Signal tells an API caller what is wrong.
	err := b.signal(t, o, "w-signal", "approval.granted", nil, true)
	require.ErrorIs(t, err, saga.ErrNotWaiting)
	require.ErrorContains(t, err, `but the saga is completed`)
	require.ErrorContains(t, b.signal(t, o, "w-signal", "approval.perhaps", nil, true), `no step waits for it; the saga waits for "approval.granted"`)
	require.ErrorIs(t, b.signal(t, o, "nope", "approval.granted", nil, true), saga.ErrNotFound)
}

// withoutPayment is saga data without the participant-made ids.
func withoutPayment(t *testing.T, data []byte) string {
	t.Helper()
	var o Order
	require.NoError(t, json.Unmarshal(data, &o))
	o.PaymentID, o.ReservationID = "", ""
	out, err := json.Marshal(o)
	require.NoError(t, err)
	return string(out)
}

// The event never comes: the wait's timeout compensates the earlier steps
// (the wait itself has nothing to undo), and the event arriving after it
// is recorded and ignored.
func TestWaitingStepTimeoutCompensatesAndLateEventIsIgnored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	b.def = approvalDef(t, b.tp, 200*time.Millisecond)
	o := b.startOrchestrator(t)
	b.start(t, o, "w-late")
	info := b.waitState(t, "w-late", saga.StateCompensated)
	require.Equal(t, `step "approval" timed out after 200ms`, info.Cause)
	inPlace, applied, undone := b.parts.effect("w-late", "reserve_inventory")
	require.False(t, inPlace)
	require.Equal(t, []int{1, 1}, []int{applied, undone}, "reserve undone once")
	require.Equal(t, []string{"reserve_inventory/forward/1", "reserve_inventory/compensation/1"}, b.parts.commands("w-late"), "charge never asked")

	b.sendEvent(t, o, "w-late", "approval.granted", map[string]int{"Amount": 1})
	h := b.waitHistory(t, "w-late", saga.KindLateReply)
	late := h[slices.IndexFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindLateReply })]
	require.Equal(t, "approval", late.Step)
	require.Equal(t, "approval.granted", late.Detail)
	info, _ = b.info(t, "w-late")
	require.Equal(t, saga.StateCompensated, info.State)
	require.Equal(t, 1.0, metricValue(t, o.reg, saga.MetricIgnoredReplies, map[string]string{"type": "orders", "kind": saga.KindLateReply}))

	err := b.signal(t, o, "w-late", "approval.granted", nil, true)
	require.ErrorIs(t, err, saga.ErrNotWaiting)
	require.ErrorContains(t, err, `compensated (step "approval" timed out after 200ms)`)
	require.Equal(t, []string{"reserve_inventory/forward/1", "reserve_inventory/compensation/1"}, b.parts.commands("w-late"))
}

// An orchestrator killed while sagas wait: a new one fires the wait's
// deadline of one (compensated) and continues the other on its event
// (sent through the transport once the new one runs).
func TestWaitingStepSurvivesOrchestratorRestart(t *testing.T) {
	t.Parallel()
	const wait = 5 * time.Second
	b := setup(t, nil, defOpts{})
	b.def = approvalDef(t, b.tp, wait)
	first := b.startOrchestrator(t)
	for _, id := range []string{"k-never", "k-event"} {
		b.start(t, first, id)
		b.waitHistory(t, id, saga.KindWait)
	}
	first.stop()
	for _, id := range []string{"k-never", "k-event"} {
		info, _ := b.info(t, id)
		require.Equal(t, saga.StateRunning, info.State)
		require.True(t, time.Now().Before(info.Deadline), "the first orchestrator stopped after the wait's deadline (%s): the machine is too slow for this test", info.Deadline)
	}

	second := b.startOrchestrator(t)
	b.sendEvent(t, second, "k-event", "approval.granted", map[string]int{"Amount": 7})
	b.waitState(t, "k-event", saga.StateCompleted)
	_, applied, _ := b.parts.effect("k-event", "charge_payment")
	require.Equal(t, 1, applied)

	info := b.waitState(t, "k-never", saga.StateCompensated)
	require.Contains(t, info.Cause, `step "approval" timed out`)
	_, _, undone := b.parts.effect("k-never", "reserve_inventory")
	require.Equal(t, 1, undone)
	require.Equal(t, 1.0, metricValue(t, second.reg, saga.MetricCompensated, map[string]string{"type": "orders"}), "the new orchestrator fired the deadline")
	require.Zero(t, metricValue(t, first.reg, saga.MetricCompensated, map[string]string{"type": "orders"}))
}

// retryDef is reserve_inventory (compensated), a timer, then
// charge_payment and schedule_shipping, Retriable (3 attempts).
func retryDef(t *testing.T, tp topics) *saga.Definition[Order] {
	t.Helper()
	cmd := func(topic, typ string) func(Order) (saga.Command, error) {
		return func(o Order) (saga.Command, error) { return saga.Command{Topic: topic, Type: typ, Payload: o}, nil }
	}
	pol := retry.Policy{InitialInterval: 10 * time.Millisecond, MaxAttempts: 3, Jitter: retry.JitterNone}
	return saga.MustDefine("orders",
		saga.Step[Order]{Name: "reserve_inventory", Command: cmd(tp.inventory, "inventory.reserve.v1"),
			Compensation: cmd(tp.inventory, "inventory.release.v1"), Timeout: 30 * time.Second},
		saga.Step[Order]{Name: "cool_off", Sleep: 50 * time.Millisecond},
		saga.Step[Order]{Name: "charge_payment", Command: cmd(tp.payment, "payment.charge.v1"), Retriable: true, Retry: pol, Timeout: 30 * time.Second},
		saga.Step[Order]{Name: "schedule_shipping", Command: cmd(tp.shipping, "shipping.schedule.v1"), Retriable: true, Retry: pol, Timeout: 30 * time.Second},
	)
}

// A Retriable step that fails is sent again, never compensated; past its
// budget the saga is stuck, and `saga resolve` retry sends the command
// again, skip goes on with the next step.
func TestRetriableStepRetriesThenStuckThenResolved(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	b.def = retryDef(t, b.tp)
	broken := map[string]bool{"r-stuck": true, "r-skip": true}
	b.parts.setDecide(func(id, step, phase string, attempt int) action {
		if step != "charge_payment" {
			return succeed
		}
		if broken[id] || attempt < 3 {
			return fail
		}
		return succeed
	})
	o := b.startOrchestrator(t)
	for _, id := range []string{"r-ok", "r-stuck", "r-skip"} {
		b.start(t, o, id)
	}

	b.waitState(t, "r-ok", saga.StateCompleted)
	require.Equal(t, []string{"reserve_inventory/forward/1", "charge_payment/forward/1", "charge_payment/forward/2", "charge_payment/forward/3",
		"schedule_shipping/forward/1"}, b.parts.commands("r-ok"), "retried, never compensated")
	_, kinds := b.info(t, "r-ok")
	require.Contains(t, kinds, "cool_off:timer")
	require.Contains(t, kinds, "cool_off:timer_fired")

	for _, id := range []string{"r-stuck", "r-skip"} {
		info := b.waitState(t, id, saga.StateStuck)
		require.Equal(t, "charge_payment", info.Step)
		require.Contains(t, info.LastError, `step "charge_payment" failed (attempt 3)`)
		require.Equal(t, []string{"reserve_inventory/forward/1", "charge_payment/forward/1", "charge_payment/forward/2", "charge_payment/forward/3"}, b.parts.commands(id))
		_, _, undone := b.parts.effect(id, "reserve_inventory")
		require.Zero(t, undone, "nothing compensated")
	}
	o.logs.waitErrorsLogged(t, "stuck log", func(m []watermill.CapturedMessage) bool {
		return slices.ContainsFunc(m, func(m watermill.CapturedMessage) bool {
			return m.Msg == "saga: stuck: retries of the Retriable step's command exhausted; fix the participant, then run `millwright saga resolve r-stuck`"
		})
	})

	ctx := context.Background()
	r, err := b.resolve(ctx, "r-stuck", saga.ResolveRetry, "", true)
	require.NoError(t, err)
	require.Contains(t, r.Description, `send the command of Retriable step "charge_payment" (index 2) again with a fresh retry budget`)
	b.parts.mu.Lock()
	broken["r-stuck"] = false
	b.parts.mu.Unlock()
	_, err = b.resolve(ctx, "r-stuck", saga.ResolveRetry, "payments fixed", false)
	require.NoError(t, err)
	b.waitState(t, "r-stuck", saga.StateCompleted)
	require.Equal(t, []string{"charge_payment/forward/4", "schedule_shipping/forward/1"}, b.parts.commands("r-stuck")[4:], "a new round, numbered after the earlier attempts")

	r, err = b.resolve(ctx, "r-skip", saga.ResolveSkip, "charged by hand", false)
	require.NoError(t, err)
	require.Contains(t, r.Description, `mark Retriable step "charge_payment" (index 2) as done by hand and go on with the next step`)
	b.waitState(t, "r-skip", saga.StateCompleted)
	require.Equal(t, []string{"schedule_shipping/forward/1"}, b.parts.commands("r-skip")[4:])
	_, kinds = b.info(t, "r-skip")
	require.Contains(t, kinds, "charge_payment:resolved")
}
