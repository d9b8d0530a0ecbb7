package saga_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

const (
	reserve  = "reserve_inventory"
	charge   = "charge_payment"
	shipping = "schedule_shipping"
)

func fwd(step string) string { return step + "/forward/1" }
func comp(step string, attempt int) string {
	return fmt.Sprintf("%s/compensation/%d", step, attempt)
}

// On both drivers: on pgx the orchestrator runs on a *pgxpool.Pool, the
// saga starts in a pgx.Tx and the participants write their effects and
// replies in pgx.Tx (helpers_test.go).
func TestHappyPath(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver, defOpts{})
		o := b.startOrchestrator(t)
		b.start(t, o, "order-1")

		info := b.waitState(t, "order-1", saga.StateCompleted)
		require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping)}, b.parts.commands("order-1"))
		require.JSONEq(t, `{"id":"order-1","amount":42,"reservation_id":"reserve_inventory-order-1","payment_id":"charge_payment-order-1"}`, string(info.Data))
		require.Empty(t, info.Step)
		require.True(t, info.Deadline.IsZero(), "a completed saga has no deadline")

		_, h, err := saga.Get(context.Background(), b.handle(), "order-1")
		require.NoError(t, err)
		require.Equal(t, []string{
			reserve + ":command", reserve + ":reply",
			charge + ":command", charge + ":reply",
			shipping + ":command", shipping + ":reply", shipping + ":completed",
		}, historyKinds(h))
		require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricCompleted, map[string]string{"type": "orders"}))
		require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricDuration, map[string]string{"type": "orders", "outcome": "completed"}))
		if b.pgx != nil {
			require.Equal(t, 3, b.effects(t, "order-1"), "each participant's effect committed with its reply")
		}

		// A second Start with the same id does nothing, and leaves the
		// transaction usable.
		ctx := context.Background()
		if b.pgx != nil {
			tx, err := b.pgx.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			require.ErrorIs(t, o.o.Start(ctx, postgres.PgxTx(tx), "order-1", Order{}), saga.ErrAlreadyStarted)
			var one int
			require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one))
			return
		}
		tx, err := b.schema.DB.Begin()
		require.NoError(t, err)
		defer tx.Rollback()
		require.ErrorIs(t, o.o.Start(ctx, postgres.SQLTx(tx), "order-1", Order{}), saga.ErrAlreadyStarted)
		_, err = tx.Exec(`SELECT 1`)
		require.NoError(t, err)
	})
}

// Failure at step i runs exactly the compensations of steps i-1..0.
func TestFailureAtEachStepCompensatesEarlierStepsInReverse(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testFailureAtEachStep(t, setupDriver(t, driver, defOpts{}))
	})
}

func testFailureAtEachStep(t *testing.T, b *bundle) {
	o := b.startOrchestrator(t)
	failAt := map[string]string{"fail-0": reserve, "fail-1": charge, "fail-2": shipping}
	b.parts.setDecide(func(id, step, phase string, _ int) action {
		if phase == saga.PhaseForward && failAt[id] == step {
			return fail
		}
		return succeed
	})
	for id := range failAt {
		b.start(t, o, id)
	}
	want := map[string][]string{
		"fail-0": {fwd(reserve)},
		"fail-1": {fwd(reserve), fwd(charge), comp(reserve, 1)},
		"fail-2": {fwd(reserve), fwd(charge), fwd(shipping), comp(charge, 1), comp(reserve, 1)},
	}
	for id, cmds := range want {
		info := b.waitState(t, id, saga.StateCompensated)
		require.Equal(t, cmds, b.parts.commands(id), id)
		require.Contains(t, info.LastError, failAt[id]+" forward refused")
	}
	_, h, err := saga.Get(context.Background(), b.handle(), "fail-2")
	require.NoError(t, err)
	require.Equal(t, shipping+" forward refused", h[5].Error)
	require.EqualValues(t, 3, metricValue(t, o.reg, saga.MetricCompensated, map[string]string{"type": "orders"}))
}

// A step that never answers times out; its own compensation runs too (its
// effect is unknown), then the earlier ones. What arrives late is recorded
// and ignored when there is nothing to undo: the success of a step declared
// NoCompensation (its effect is kept, by that declaration), or a failure.
// (A late success of a step with a compensation is undone: late_test.go.)
func TestStepTimeoutAndLateReply(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		step      string
		reply     string
		compBelow []string // compensations after the timeout
	}{
		"success of a NoCompensation step": {shipping, shipping + ".succeeded", []string{comp(charge, 1), comp(reserve, 1)}},
		"failure of a compensated step":    {charge, charge + ".failed", []string{comp(charge, 1), comp(reserve, 1)}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil, defOpts{timeouts: map[string]time.Duration{tc.step: 300 * time.Millisecond}})
			o := b.startOrchestrator(t)
			b.parts.setDecide(func(_, step, phase string, _ int) action {
				if step == tc.step && phase == saga.PhaseForward {
					return ignore
				}
				return succeed
			})
			b.start(t, o, "slow")
			info := b.waitState(t, "slow", saga.StateCompensated)
			var fwds []string
			for _, s := range []string{reserve, charge, shipping} {
				fwds = append(fwds, fwd(s))
				if s == tc.step {
					break
				}
			}
			require.Equal(t, append(fwds, tc.compBelow...), b.parts.commands("slow"))
			cause := fmt.Sprintf("step %q timed out after 300ms", tc.step)
			require.Equal(t, cause, info.LastError)
			require.Equal(t, cause, info.Cause)

			// The service answers at last.
			late, err := saga.NewReply(b.parts.command("slow", tc.step, saga.PhaseForward), tc.reply, map[string]string{"ID": "p1"})
			require.NoError(t, err)
			require.NoError(t, b.tr.Publisher().Publish(b.tp.replies, late))
			h := b.waitHistory(t, "slow", saga.KindLateReply)
			after, _, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "slow")
			require.NoError(t, err)
			require.Equal(t, saga.StateCompensated, after.State)
			require.Equal(t, info.Version, after.Version, "a late reply changes nothing")
			require.Contains(t, historyKinds(h), tc.step+":timeout")
			require.Equal(t, tc.step+":late_reply", historyKinds(h)[len(h)-1])
			require.Equal(t, append(fwds, tc.compBelow...), b.parts.commands("slow"), "nothing sent")
			require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricIgnoredReplies, map[string]string{"type": "orders", "kind": "late_reply"}))
			require.EqualValues(t, 0, metricValue(t, o.reg, saga.MetricLateSuccesses, map[string]string{"type": "orders"}))
		})
	}
}

// The same reply delivered twice is dropped by the idempotency middleware;
// a second, different reply to an answered command is recorded as a
// duplicate and ignored.
func TestDuplicateReplies(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	o := b.startOrchestrator(t)
	b.start(t, o, "dup")
	before := b.waitState(t, "dup", saga.StateCompleted)

	cmd := b.parts.command("dup", reserve, saga.PhaseForward)
	again, err := saga.NewReply(cmd, reserve+".succeeded", map[string]string{"ID": "other"})
	require.NoError(t, err)
	require.NoError(t, b.tr.Publisher().Publish(b.tp.replies, again))
	b.waitHistory(t, "dup", saga.KindDuplicate)

	// The very same message again (same event id): the middleware skips it.
	require.NoError(t, b.tr.Publisher().Publish(b.tp.replies, again.Copy()))
	require.Eventually(t, func() bool {
		return metricValue(t, o.reg, idempotency.MetricDuplicates, map[string]string{"consumer": "orders-saga"}) >= 1
	}, 30*time.Second, 10*time.Millisecond)

	after, h, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "dup")
	require.NoError(t, err)
	require.Equal(t, before.Version, after.Version)
	require.Equal(t, before.Data, after.Data, "the duplicate's payload is not applied")
	n := 0
	for _, e := range h {
		if e.Kind == saga.KindDuplicate {
			n++
		}
	}
	require.Equal(t, 1, n)
}

func TestCompensationFailsThenSucceeds(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(_, step, phase string, attempt int) action {
		switch {
		case step == shipping:
			return fail
		case step == charge && phase == saga.PhaseCompensation && attempt < 3:
			return fail
		}
		return succeed
	})
	b.start(t, o, "flaky-refund")
	b.waitState(t, "flaky-refund", saga.StateCompensated)
	require.Equal(t, []string{
		fwd(reserve), fwd(charge), fwd(shipping),
		comp(charge, 1), comp(charge, 2), comp(charge, 3), comp(reserve, 1),
	}, b.parts.commands("flaky-refund"))
}

// A compensation that keeps failing makes the saga stuck (metric, state);
// an operator fixes the participant and resolves it.
func TestCompensationPastBudgetIsStuckThenResolved(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testStuckThenResolved(t, setupDriver(t, driver, defOpts{retry: retry.Policy{InitialInterval: 5 * time.Millisecond, MaxAttempts: 3, Jitter: retry.JitterNone}}))
	})
}

func testStuckThenResolved(t *testing.T, b *bundle) {
	o := b.startOrchestrator(t)
	refundBroken := true
	b.parts.setDecide(func(_, step, phase string, _ int) action {
		switch {
		case step == shipping:
			return fail
		case step == charge && phase == saga.PhaseCompensation && refundBroken:
			return fail
		}
		return succeed
	})
	ctx := context.Background()
	b.start(t, o, "stuck-retry")
	b.start(t, o, "stuck-skip")
	for _, id := range []string{"stuck-retry", "stuck-skip"} {
		info := b.waitState(t, id, saga.StateStuck)
		require.Equal(t, charge, info.Step)
		require.Equal(t, 3, info.CompensationAttempts)
		require.Contains(t, info.LastError, "charge_payment compensation refused")
		require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping), comp(charge, 1), comp(charge, 2), comp(charge, 3)}, b.parts.commands(id))
	}
	require.EqualValues(t, 2, metricValue(t, o.reg, saga.MetricStuck, map[string]string{"type": "orders"}))
	var stuckLines []string
	logged := o.logs.waitErrorsLogged(t, "both stuck sagas", func(ls []watermill.CapturedMessage) bool { return len(ls) >= 2 })
	for _, l := range logged {
		require.Contains(t, l.Msg, "saga: stuck")
		require.Equal(t, charge, l.Fields["step"])
		require.ErrorContains(t, l.Err, "charge_payment compensation refused")
		stuckLines = append(stuckLines, l.Fields["saga_id"].(string))
	}
	require.ElementsMatch(t, []string{"stuck-retry", "stuck-skip"}, stuckLines, "one error line per stuck saga")

	// Dry run: says what it would do, changes nothing.
	r, err := b.resolve(ctx, "stuck-retry", saga.ResolveRetry, "", true)
	require.NoError(t, err)
	require.Contains(t, r.Description, `resend the compensation of step "charge_payment"`)
	info, _, err := saga.Get(ctx, b.handle(), "stuck-retry")
	require.NoError(t, err)
	require.Equal(t, saga.StateStuck, info.State)

	b.parts.setDecide(func(_, step, _ string, _ int) action {
		if step == shipping {
			return fail
		}
		return succeed
	})
	refundBroken = false
	_, err = b.resolve(ctx, "stuck-retry", saga.ResolveRetry, "payment service fixed", false)
	require.NoError(t, err)
	b.waitState(t, "stuck-retry", saga.StateCompensated)
	// A new round of the refund, numbered after the stuck round's attempts
	// (a late reply to attempt 1 cannot answer it).
	require.Equal(t, []string{comp(charge, 4), comp(reserve, 1)}, b.parts.commands("stuck-retry")[6:])

	// Skip: the refund was done by hand; only the release follows.
	_, err = b.resolve(ctx, "stuck-skip", saga.ResolveSkip, "refunded by hand", false)
	require.NoError(t, err)
	b.waitState(t, "stuck-skip", saga.StateCompensated)
	require.Equal(t, []string{comp(reserve, 1)}, b.parts.commands("stuck-skip")[6:])
	h, err := saga.History(ctx, b.handle(), "stuck-skip")
	require.NoError(t, err)
	require.Contains(t, historyKinds(h), charge+":resolved")

	_, err = b.resolve(ctx, "stuck-skip", saga.ResolveRetry, "", false)
	require.ErrorIs(t, err, saga.ErrNotStuck)
	_, err = b.resolve(ctx, "nope", saga.ResolveRetry, "", false)
	require.ErrorIs(t, err, saga.ErrNotFound)
}

// Two orchestrator instances; one dies mid-saga, the other finishes every
// saga: replies and deadlines alike.
func TestCrashWithTwoOrchestrators(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{timeouts: map[string]time.Duration{shipping: 3 * time.Second}})
	var held sync.WaitGroup
	held.Add(2)
	hold := make(chan struct{})
	b.parts.setDecide(func(id, step, phase string, _ int) action {
		if id == "timeout-after-crash" && step == shipping {
			return ignore
		}
		return succeed
	})
	// The payment service answers only after A has died, so the rest of
	// both sagas (replies and the shipping timeout) is up to the survivor.
	b.parts.before = func(_, step, phase string) {
		if step == charge && phase == saga.PhaseForward {
			held.Done()
			<-hold
		}
	}
	a := b.startOrchestrator(t)
	other := b.startOrchestrator(t)

	b.start(t, a, "survivor")
	b.start(t, a, "timeout-after-crash")
	held.Wait()
	a.stop()
	close(hold)

	b.waitState(t, "survivor", saga.StateCompleted)
	b.waitState(t, "timeout-after-crash", saga.StateCompensated)
	require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping)}, b.parts.commands("survivor"))
	// Shipping has no compensation; payment and inventory are undone.
	require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping), comp(charge, 1), comp(reserve, 1)}, b.parts.commands("timeout-after-crash"))
	require.EqualValues(t, 1, metricValue(t, other.reg, saga.MetricCompensated, map[string]string{"type": "orders"}),
		"the surviving instance fired the timeout")
	require.EqualValues(t, 1, metricValue(t, other.reg, saga.MetricCompleted, map[string]string{"type": "orders"}))
}

// The orchestrator dies after applying a reply but before its transaction
// commits (the handler fails inside the idempotency middleware): the state
// change, history and next command roll back together, the reply is
// redelivered, and each command is written exactly once.
func TestCrashBeforeCommitWritesEachCommandOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	var crashed sync.Map
	b.replyMiddleware = func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				if _, done := crashed.LoadOrStore(msg.Metadata.Get(metadata.SagaStep), true); !done {
					return nil, errors.New("orchestrator died before commit")
				}
			}
			return out, err
		}
	}
	o := b.startOrchestrator(t)
	b.start(t, o, "crashy")
	b.waitState(t, "crashy", saga.StateCompleted)
	require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping)}, b.parts.commands("crashy"))

	var perTopic []int
	rows, err := b.schema.DB.Query(`SELECT count(*) FROM millwright_outbox GROUP BY topic ORDER BY topic`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var n int
		require.NoError(t, rows.Scan(&n))
		perTopic = append(perTopic, n)
	}
	require.Equal(t, []int{1, 1, 1}, perTopic, "one command per step")
	h, err := saga.History(context.Background(), postgres.From(b.schema.DB), "crashy")
	require.NoError(t, err)
	require.Len(t, h, 7, "%v", historyKinds(h))
	require.EqualValues(t, 3, metricValue(t, o.reg, idempotency.MetricProcessed, map[string]string{"consumer": "orders-saga"}))
	crashes := 0
	crashed.Range(func(_, _ any) bool { crashes++; return true })
	require.Equal(t, 3, crashes, "the orchestrator died before commit once per step's reply")
}

// A command that cannot be built fails the saga at its step: the steps
// done so far are compensated, and the history names the error.
func TestCommandBuildErrorCompensates(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	o := b.startOrchestrator(t)
	require.NoError(t, o.o.StartOutsideTx(context.Background(), postgres.From(b.schema.DB), "negative", Order{ID: "negative", Amount: -1}))
	info := b.waitState(t, "negative", saga.StateCompensated)
	require.Equal(t, []string{fwd(reserve), comp(reserve, 1)}, b.parts.commands("negative"))
	require.Contains(t, info.LastError, `step "charge_payment": building command: negative amount -1`)
	h, err := saga.History(context.Background(), postgres.From(b.schema.DB), "negative")
	require.NoError(t, err)
	require.Equal(t, charge+":command", historyKinds(h)[2])
	require.Contains(t, h[2].Error, "negative amount")
}
