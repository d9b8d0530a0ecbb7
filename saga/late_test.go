package saga_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

// waitLateUndone waits until saga id has recorded a late success and is
// compensated again after it, and returns the history.
func (b *bundle) waitLateUndone(t *testing.T, id string) []saga.HistoryEntry {
	t.Helper()
	var h []saga.HistoryEntry
	poll.Until(t, 30*time.Second, func() bool {
		var err error
		h, err = saga.History(context.Background(), postgres.From(b.schema.DB), id)
		require.NoError(t, err)
		late := slices.IndexFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindLateSuccess })
		return late >= 0 && h[len(h)-1].Kind == saga.KindCompensated && len(h)-1 > late
	}, "saga %s: a late success undone and the saga compensated again; history %v; commands %v", id, historyKinds(h), b.parts.commands(id))
	return h
}

// after returns the history kinds from the late success on.
func afterLate(h []saga.HistoryEntry) []string {
	i := slices.IndexFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindLateSuccess })
	return historyKinds(h[i:])
}

// A step that timed out may still run: its participant was down past the
// timeout, then worked through its backlog. Whatever it made of the
// compensation sent at the timeout (here it ran first and found nothing to
// undo, as a participant without a tombstone does), the late success makes
// the orchestrator send the step's compensation again, once, and the
// effect is undone. Each case has the late success arrive at another point
// of the compensation.
func TestLateSuccessIsCompensated(t *testing.T) {
	t.Parallel()
	const cause = `step "schedule_shipping" timed out after 300ms`
	opts := defOpts{cancelShipping: true, timeouts: map[string]time.Duration{shipping: 300 * time.Millisecond}}

	t.Run("after the saga is compensated", func(t *testing.T) { lateCompensatedAfterTheSagaIsCompensated(t, opts, cause) })

	t.Run("while an earlier step is compensated", func(t *testing.T) { lateCompensatedWhileAnEarlierStepIsCompensated(t, opts) })

	t.Run("while its own compensation is unanswered", func(t *testing.T) { lateCompensatedWhileItsOwnCompensationIsUnanswered(t, opts) })

	// The orchestrator dies after applying the late success, before its
	// transaction commits: the record and the compensation roll back
	// together, the reply is redelivered, and the compensation is written
	// once.
	t.Run("orchestrator dies before commit", func(t *testing.T) { lateCompensatedOrchestratorDiesBeforeCommit(t, opts) })
}

func lateCompensatedAfterTheSagaIsCompensated(t *testing.T, opts defOpts, cause string) {
	// On both drivers: on pgx the participants answer from a pgx.Tx and
	// the orchestrator runs on a *pgxpool.Pool.
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver, opts)
		o := b.startOrchestrator(t)
		b.parts.setDecide(func(_, step, phase string, _ int) action {
			if step == shipping && phase == saga.PhaseForward {
				return hold
			}
			return succeed
		})
		b.start(t, o, "late")
		first := b.waitState(t, "late", saga.StateCompensated)
		require.Equal(t, cause, first.LastError)
		inPlace, applied, _ := b.parts.effect("late", shipping)
		require.False(t, inPlace)
		require.Zero(t, applied, "the shipment was not made yet")

		// Shipping is back and schedules the shipment.
		n, err := b.parts.release("late", shipping, saga.PhaseForward, succeed)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		h := b.waitLateUndone(t, "late")

		require.Equal(t, []string{
			fwd(reserve), fwd(charge), fwd(shipping),
			comp(shipping, 1), comp(charge, 1), comp(reserve, 1),
			comp(shipping, 2), // numbered after attempt 1, sent once
		}, b.parts.commands("late"))
		inPlace, applied, undone := b.parts.effect("late", shipping)
		require.False(t, inPlace, "the late shipment is cancelled")
		require.Equal(t, 1, applied)
		require.Equal(t, 1, undone)
		require.Equal(t, []string{
			shipping + ":late_success", shipping + ":compensation", shipping + ":compensation_reply", ":compensated",
		}, afterLate(h))
		info, _, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "late")
		require.NoError(t, err)
		require.Equal(t, cause, info.LastError, "the reason is still the timeout")
		require.Equal(t, cause, info.Cause)
		require.Empty(t, info.Step)
		require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricLateSuccesses, map[string]string{"type": "orders"}))
		require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricCompensated, map[string]string{"type": "orders"}), "counted once")

		// The same success again, under another event id (a participant
		// that replied twice): a duplicate, nothing sent.
		again, err := saga.NewReply(b.parts.command("late", shipping, saga.PhaseForward), shipping+".succeeded", nil)
		require.NoError(t, err)
		require.NoError(t, b.tr.Publisher().Publish(b.tp.replies, again))
		h = b.waitHistory(t, "late", saga.KindDuplicate)
		require.Equal(t, shipping+":duplicate", historyKinds(h)[len(h)-1])
		after, _, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "late")
		require.NoError(t, err)
		require.Equal(t, info.Version, after.Version)
		require.Len(t, b.parts.commands("late"), 7)
	})
}

func lateCompensatedWhileAnEarlierStepIsCompensated(t *testing.T, opts defOpts) {
	t.Parallel()
	b := setup(t, nil, opts)
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(_, step, phase string, attempt int) action {
		switch {
		case step == shipping && phase == saga.PhaseForward:
			return hold
		case step == charge && phase == saga.PhaseCompensation && attempt == 1:
			return hold // the refund is slow
		}
		return succeed
	})
	b.start(t, o, "late")
	b.waitCommand(t, "late", comp(charge, 1))
	_, err := b.parts.release("late", shipping, saga.PhaseForward, succeed)
	require.NoError(t, err)
	h := b.waitLateUndone(t, "late")
	// The cancellation goes first; the refund it interrupted starts
	// again (attempt 2), then the release.
	require.Equal(t, []string{
		fwd(reserve), fwd(charge), fwd(shipping),
		comp(shipping, 1), comp(charge, 1), comp(shipping, 2), comp(charge, 2), comp(reserve, 1),
	}, b.parts.commands("late"))
	require.Equal(t, []string{
		shipping + ":late_success", shipping + ":compensation", shipping + ":compensation_reply",
		charge + ":compensation", charge + ":compensation_reply", reserve + ":compensation", reserve + ":compensation_reply", ":compensated",
	}, afterLate(h))
	inPlace, applied, undone := b.parts.effect("late", shipping)
	require.Equal(t, []any{false, 1, 1}, []any{inPlace, applied, undone})

	// The interrupted refund's reply arrives at last: ignored.
	_, err = b.parts.release("late", charge, saga.PhaseCompensation, succeed)
	require.NoError(t, err)
	h = b.waitHistory(t, "late", saga.KindLateReply)
	require.Equal(t, charge+":late_reply", historyKinds(h)[len(h)-1])
	require.EqualValues(t, 1, metricValue(t, o.reg, saga.MetricCompensated, map[string]string{"type": "orders"}))
}

func lateCompensatedWhileItsOwnCompensationIsUnanswered(t *testing.T, opts defOpts) {
	t.Parallel()
	b := setup(t, nil, opts)
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(_, step, phase string, attempt int) action {
		if step == shipping && (phase == saga.PhaseForward || attempt == 1) {
			return hold // shipping is down
		}
		return succeed
	})
	b.start(t, o, "late")
	b.waitCommand(t, "late", comp(shipping, 1))
	_, err := b.parts.release("late", shipping, saga.PhaseForward, succeed)
	require.NoError(t, err)
	h := b.waitLateUndone(t, "late")
	// The cancellation is sent again at once, and the chain goes on
	// from its answer.
	require.Equal(t, []string{
		fwd(reserve), fwd(charge), fwd(shipping),
		comp(shipping, 1), comp(shipping, 2), comp(charge, 1), comp(reserve, 1),
	}, b.parts.commands("late"))
	require.Equal(t, shipping+":late_success", afterLate(h)[0])
	inPlace, applied, undone := b.parts.effect("late", shipping)
	require.Equal(t, []any{false, 1, 1}, []any{inPlace, applied, undone})

	// Attempt 1's answer (it finds nothing left to cancel) is late.
	_, err = b.parts.release("late", shipping, saga.PhaseCompensation, succeed)
	require.NoError(t, err)
	h = b.waitHistory(t, "late", saga.KindLateReply)
	require.Equal(t, shipping+":late_reply", historyKinds(h)[len(h)-1])
	_, _, undone = b.parts.effect("late", shipping)
	require.Equal(t, 1, undone)
}

func lateCompensatedOrchestratorDiesBeforeCommit(t *testing.T, opts defOpts) {
	t.Parallel()
	b := setup(t, nil, opts)
	var crashes atomic.Int32
	b.replyMiddleware = func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.Metadata.Get(metadata.SagaStep) == shipping && msg.Metadata.Get(metadata.SagaPhase) == saga.PhaseForward &&
				crashes.CompareAndSwap(0, 1) {
				return nil, errors.New("orchestrator died before commit")
			}
			return out, err
		}
	}
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(_, step, phase string, _ int) action {
		if step == shipping && phase == saga.PhaseForward {
			return hold
		}
		return succeed
	})
	b.start(t, o, "late")
	b.waitState(t, "late", saga.StateCompensated)
	_, err := b.parts.release("late", shipping, saga.PhaseForward, succeed)
	require.NoError(t, err)
	h := b.waitLateUndone(t, "late")
	require.EqualValues(t, 1, crashes.Load(), "the crash happened")
	require.Equal(t, []string{
		shipping + ":late_success", shipping + ":compensation", shipping + ":compensation_reply", ":compensated",
	}, afterLate(h), "recorded once")
	var cancels int
	require.NoError(t, b.schema.DB.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE topic = $1 AND event_type = 'shipping.cancel.v1'`,
		b.tp.shipping).Scan(&cancels))
	require.Equal(t, 2, cancels, "the cancellation at the timeout and the one for the late success")
	_, _, undone := b.parts.effect("late", shipping)
	require.Equal(t, 1, undone)
}

// When compensations fail or time out, the saga's last error still names
// why it is compensating, and goes back to exactly that once the saga is
// compensated (the orders example shows it as the cancellation reason).
func TestCompensationTimeoutKeepsCause(t *testing.T) {
	t.Parallel()
	const cause = `step "schedule_shipping" failed: schedule_shipping forward refused`
	b := setup(t, nil, defOpts{
		compTimeouts: map[string]time.Duration{charge: 200 * time.Millisecond},
		retry:        retry.Policy{InitialInterval: 5 * time.Millisecond, MaxAttempts: 2, Jitter: retry.JitterNone},
	})
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(id, step, phase string, attempt int) action {
		switch {
		case step == shipping:
			return fail
		case step == charge && phase == saga.PhaseCompensation && (id == "stuck" || attempt == 1):
			return ignore // the refund times out
		}
		return succeed
	})
	b.start(t, o, "stuck")
	b.start(t, o, "recovers")

	info := b.waitState(t, "stuck", saga.StateStuck)
	require.Equal(t, cause+`; then compensation of step "charge_payment" (attempt 2) timed out after 200ms`, info.LastError)
	require.Equal(t, cause, info.Cause)
	stuckLogged := func(ls []watermill.CapturedMessage) bool {
		for _, l := range ls {
			if l.Fields["saga_id"] == "stuck" {
				return true
			}
		}
		return false
	}
	for _, l := range o.logs.waitErrorsLogged(t, "the stuck saga", stuckLogged) {
		if l.Fields["saga_id"] == "stuck" {
			require.ErrorContains(t, l.Err, cause, "the stuck saga is logged with its cause")
		}
	}

	info = b.waitState(t, "recovers", saga.StateCompensated)
	require.Equal(t, cause, info.LastError)
	h, err := saga.History(context.Background(), postgres.From(b.schema.DB), "recovers")
	require.NoError(t, err)
	require.Contains(t, historyKinds(h), charge+":timeout")
	require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping), comp(charge, 1), comp(charge, 2), comp(reserve, 1)}, b.parts.commands("recovers"))
	require.Equal(t, fmt.Sprintf("compensation of step %q (attempt 1) timed out after 200ms", charge), h[slices.IndexFunc(h, func(e saga.HistoryEntry) bool {
		return e.Kind == saga.KindTimeout
	})].Error)
}
