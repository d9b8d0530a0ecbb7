package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/saga"
)

// groupOrdersDef is reserve_inventory, then the group fulfil of
// charge_payment and schedule_shipping (cancelled by shipping.cancel.v1),
// run at once.
func groupOrdersDef(t *testing.T, tp topics) *saga.Definition[Order] {
	t.Helper()
	def, err := saga.Define("orders", stepOf(tp, reserve),
		saga.Step[Order]{Name: "fulfil", Parallel: []saga.Step[Order]{stepOf(tp, charge), stepOf(tp, shipping)}})
	require.NoError(t, err)
	return def
}

// stepOf is step name, on its participant's topic, with a compensation.
func stepOf(tp topics, name string) saga.Step[Order] {
	topic := map[string]string{reserve: tp.inventory, charge: tp.payment, shipping: tp.shipping}[name]
	return saga.Step[Order]{
		Name: name,
		Command: func(o Order) (saga.Command, error) {
			return saga.Command{Topic: topic, Type: name + ".v1", Payload: o}, nil
		},
		Compensation: func(o Order) (saga.Command, error) {
			return saga.Command{Topic: topic, Type: name + ".undo.v1", Payload: o}, nil
		},
		Timeout: 30 * time.Second, CompensationTimeout: 30 * time.Second,
	}
}

// A branch fails while the other is in flight: the saga waits for it; once
// it succeeds, it alone of the two is compensated, once, then the step
// before the group. Counted from the participants' side.
func TestGroupBranchFailsWhileTheOtherIsInFlight(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testGroupBranchFailsWhileTheOtherIsInFlight(t, setupDriver(t, driver, defOpts{}))
	})
}

func testGroupBranchFailsWhileTheOtherIsInFlight(t *testing.T, b *bundle) {
	b.def = groupOrdersDef(t, b.tp)
	o := b.startOrchestrator(t)
	b.parts.setDecide(func(_, step, phase string, _ int) action {
		switch {
		case phase == saga.PhaseForward && step == charge:
			return fail
		case phase == saga.PhaseForward && step == shipping:
			return hold
		}
		return succeed
	})
	const id = "group-1"
	b.start(t, o, id)

	// charge_payment's failure is handled while schedule_shipping is
	// held: the saga waits, compensating nothing.
	poll.Until(t, 30*time.Second, func() bool { return b.parts.heldCount(id, shipping, saga.PhaseForward) == 1 }, "schedule_shipping's command held")
	var info saga.Info
	poll.Until(t, 30*time.Second, func() bool {
		// The instance row alone (Get reads the history separately).
		var err error
		info, _, err = saga.Get(context.Background(), b.handle(), id)
		require.NoError(t, err)
		return info.Branches[charge].State == saga.BranchFailed
	}, "charge_payment's failure recorded")
	require.Equal(t, saga.StateRunning, info.State, "the in-flight branch is awaited")
	require.Contains(t, info.Cause, `branch "charge_payment" failed`)
	require.Equal(t, map[string]saga.BranchInfo{
		charge:   {State: saga.BranchFailed},
		shipping: {State: saga.BranchRunning, Deadline: info.Branches[shipping].Deadline},
	}, info.Branches)
	require.False(t, info.Branches[shipping].Deadline.IsZero())

	n, err := b.parts.release(id, shipping, saga.PhaseForward, succeed)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	info = b.waitState(t, id, saga.StateCompensated)
	require.Equal(t, saga.BranchSucceeded, info.Branches[shipping].State)

	cmds := b.parts.commands(id)
	require.Len(t, cmds, 5, cmds)
	require.Equal(t, fwd(reserve), cmds[0])
	require.ElementsMatch(t, []string{fwd(charge), fwd(shipping)}, cmds[1:3], "both branches sent at once")
	require.Equal(t, []string{comp(shipping, 1), comp(reserve, 1)}, cmds[3:], "the succeeded branch, then the step before the group")
	for step, want := range map[string][2]int{reserve: {1, 1}, charge: {0, 0}, shipping: {1, 1}} {
		inPlace, applied, undone := b.parts.effect(id, step)
		require.False(t, inPlace, step)
		require.Equal(t, want, [2]int{applied, undone}, "%s: applied, undone", step)
	}
}
