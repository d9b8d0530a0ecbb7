package sagatest_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

// Parallel groups, waiting, timer and Retriable steps in the simulator,
// with no database (go test -run Sim ./saga/sagatest/).

func orderCmd(typ string) func(simOrder) (saga.Command, error) {
	return func(o simOrder) (saga.Command, error) {
		return saga.Command{Topic: "commands", Type: typ, Payload: o}, nil
	}
}

// groupSim is reserve, then the group pay of charge (10s, refund) and
// pack (20s, unpack), then ship.
func groupSim(t *testing.T) *sagatest.Simulator[simOrder] {
	t.Helper()
	def, err := saga.Define("orders",
		saga.Step[simOrder]{Name: "reserve", Command: orderCmd("reserve"), Compensation: orderCmd("release"), Timeout: 10 * time.Second},
		saga.Step[simOrder]{Name: "pay", Parallel: []saga.Step[simOrder]{
			{Name: "charge", Command: orderCmd("charge"), Compensation: orderCmd("refund"), Timeout: 10 * time.Second},
			{Name: "pack", Command: orderCmd("pack"), Compensation: orderCmd("unpack"), Timeout: 20 * time.Second},
		}},
		saga.Step[simOrder]{Name: "ship", Command: orderCmd("ship"), NoCompensation: true, Timeout: 10 * time.Second},
	)
	require.NoError(t, err)
	return newSim(t, def)
}

func TestSimGroupAllSucceed(t *testing.T) {
	t.Parallel()
	sim := groupSim(t)
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "pack/forward/1", "ship/forward/1"}, sim.Trace("o-1"))
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Equal(t, saga.BranchSucceeded, info.Branches["charge"].State)
	require.Equal(t, saga.BranchSucceeded, info.Branches["pack"].State)
}

func TestSimGroupBranchFailsWhileOtherInFlight(t *testing.T) {
	t.Parallel()
	sim := groupSim(t)
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.Succeed("o-1", "reserve"))
	// Both branches' commands go at once.
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "pack/forward/1"}, sim.Trace("o-1"))

	require.NoError(t, sim.Fail("o-1", "charge", "card declined"))
	// pack is in flight: it is awaited, nothing is compensated yet.
	require.Equal(t, saga.StateRunning, sim.State("o-1"))
	require.Len(t, sim.Sent("o-1"), 3)

	require.NoError(t, sim.Succeed("o-1", "pack"))
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	// Exactly the branch that succeeded is undone, once, then the step
	// before the group; the failed branch is not.
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "pack/forward/1",
		"pack/compensation/1", "reserve/compensation/1"}, sim.Trace("o-1"))
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Contains(t, info.Cause, "card declined")
}

func TestSimGroupLateSuccessAfterTimeout(t *testing.T) {
	t.Parallel()
	sim := groupSim(t)
	require.NoError(t, sim.OnStep("pack", sagatest.Silent))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, sagatest.SimEpoch.Add(20*time.Second), sim.Now(), "pack timed out after its own 20s")
	// The timed-out branch is compensated (its effect is unknown), and
	// the one that succeeded, last declared first, then reserve.
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "pack/forward/1",
		"pack/compensation/1", "charge/compensation/1", "reserve/compensation/1"}, sim.Trace("o-1"))

	// pack's success arrives after all: undone again.
	require.NoError(t, sim.Succeed("o-1", "pack"))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, "pack/compensation/2", sim.Trace("o-1")[6])
	require.Len(t, sim.Sent("o-1"), 7)
	counts := map[string]int{}
	for _, c := range sim.Sent("o-1") {
		if c.Phase == saga.PhaseCompensation {
			counts[c.Step]++
		}
	}
	require.Equal(t, map[string]int{"pack": 2, "charge": 1, "reserve": 1}, counts)
}

// waitSim is reserve, approval (waits up to 1h for order.approved; its
// payload's reservation goes into the data), ship.
func waitSim(t *testing.T) *sagatest.Simulator[simOrder] {
	t.Helper()
	def, err := saga.Define("orders",
		saga.Step[simOrder]{Name: "reserve", Command: orderCmd("reserve"), Compensation: orderCmd("release"), Timeout: 10 * time.Second},
		saga.Step[simOrder]{Name: "approval", WaitFor: "order.approved", Timeout: time.Hour,
			OnSuccess: func(o *simOrder, r saga.Reply) error {
				var body struct{ Reservation string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.Reservation = body.Reservation
				return nil
			}},
		saga.Step[simOrder]{Name: "ship", Command: orderCmd("ship"), NoCompensation: true, Timeout: 10 * time.Second},
	)
	require.NoError(t, err)
	return newSim(t, def)
}

func TestSimWaitEventBeforeTimeout(t *testing.T) {
	t.Parallel()
	sim := waitSim(t)
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	err := sim.Signal("o-1", "order.approved", nil)
	require.ErrorIs(t, err, saga.ErrNotWaiting, "not at the waiting step yet")
	require.NoError(t, sim.Succeed("o-1", "reserve"))
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Equal(t, "approval", info.Step)
	require.Equal(t, sim.Now().Add(time.Hour), info.Deadline)

	require.NoError(t, sim.Advance(59*time.Minute))
	require.NoError(t, sim.Signal("o-1", "order.approved", map[string]string{"reservation": "r-5"}))
	require.Equal(t, []string{"reserve/forward/1", "ship/forward/1"}, sim.Trace("o-1"))
	data, err := sim.Data("o-1")
	require.NoError(t, err)
	require.Equal(t, "r-5", data.Reservation)
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-1"))

	require.ErrorContains(t, sim.Signal("o-1", "order.shipped", nil), `no step waits for it; the saga waits for "order.approved"`)
	require.ErrorContains(t, sim.Succeed("o-1", "approval"), `step "approval" is a waiting step: it has no command to answer; deliver its event "order.approved" with Signal`)
	require.ErrorIs(t, sim.Signal("o-404", "order.approved", nil), saga.ErrNotFound)
}

func TestSimWaitEventAfterTimeoutIsRecordedAndIgnored(t *testing.T) {
	t.Parallel()
	sim := waitSim(t)
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.Succeed("o-1", "reserve"))
	require.NoError(t, sim.Advance(time.Hour))
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	// The wait has nothing to undo: reserve's compensation goes first.
	require.Equal(t, []string{"reserve/forward/1", "reserve/compensation/1"}, sim.Trace("o-1"))

	// In the caller's transaction, the late event is refused...
	require.ErrorIs(t, sim.Signal("o-1", "order.approved", nil), saga.ErrNotWaiting)
	// ...through the transport it is recorded and ignored.
	require.NoError(t, sim.SignalEvent("o-1", "order.approved", nil))
	h := sim.History("o-1")
	require.Equal(t, saga.KindLateReply, h[len(h)-1].Kind)
	require.Equal(t, "order.approved", h[len(h)-1].Detail)
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Len(t, sim.Sent("o-1"), 2, "the late event sent nothing")
}

func TestSimWaitNeverComes(t *testing.T) {
	t.Parallel()
	sim := waitSim(t)
	require.NoError(t, sim.OnStep("approval", sagatest.Silent))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, sagatest.SimEpoch.Add(time.Hour), sim.Now())
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Contains(t, info.Cause, `"approval"`)

	// Scripted the other way, the event comes as soon as the saga waits.
	sim = waitSim(t)
	sim.ScriptPayload(func(c sagatest.Command) any {
		if c.Type == "order.approved" {
			return map[string]string{"reservation": "r-approved"}
		}
		return nil
	})
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-2"))
	require.Equal(t, sagatest.SimEpoch, sim.Now())
	data, err := sim.Data("o-2")
	require.NoError(t, err)
	require.Equal(t, "r-approved", data.Reservation)
	// And rejected with the step's failure event.
	sim = waitSim(t)
	require.NoError(t, sim.OnStep("approval", sagatest.Fail))
	require.NoError(t, sim.Start("o-3", simOrder{ID: "o-3"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-3"))
	require.Equal(t, sagatest.SimEpoch, sim.Now())
}

func TestSimTimerAndRetriableSteps(t *testing.T) {
	t.Parallel()
	pol := retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute, MaxAttempts: 3}
	def, err := saga.Define("orders",
		saga.Step[simOrder]{Name: "reserve", Command: orderCmd("reserve"), Compensation: orderCmd("release"), Timeout: 10 * time.Second},
		saga.Step[simOrder]{Name: "cool", Sleep: 30 * time.Minute},
		saga.Step[simOrder]{Name: "charge", Command: orderCmd("charge"), Retriable: true, Timeout: 10 * time.Second, Retry: pol},
	)
	require.NoError(t, err)

	// Two failed attempts, then the third succeeds: no compensation.
	sim := newSim(t, def)
	sim.Script(func(c sagatest.Command) sagatest.Answer {
		if c.Step == "charge" && c.Attempt < 3 {
			return sagatest.Fail
		}
		return sagatest.Succeed
	})
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "charge/forward/2", "charge/forward/3"}, sim.Trace("o-1"))
	cmds := sim.Sent("o-1")
	require.Equal(t, 30*time.Minute, cmds[1].At.Sub(cmds[0].At), "the timer held the saga 30m")
	require.Equal(t, time.Second, cmds[2].At.Sub(cmds[1].At))
	require.Equal(t, 2*time.Second, cmds[3].At.Sub(cmds[2].At))

	// Every attempt fails: stuck, never compensated; the operator retries.
	sim = newSim(t, def)
	require.NoError(t, sim.OnStep("charge", sagatest.Fail))
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateStuck, sim.State("o-2"))
	require.Len(t, sim.Sent("o-2"), 4)
	require.NoError(t, sim.OnStep("charge", sagatest.Succeed))
	res, err := sim.Resolve("o-2", saga.ResolveRetry, "")
	require.NoError(t, err)
	require.Contains(t, res.Description, `send the command of Retriable step "charge"`)
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-2"))
	require.Equal(t, "charge/forward/4", sim.Trace("o-2")[4])
	require.ErrorContains(t, sim.Succeed("o-2", "cool"), `step "cool" is a timer step: it takes no replies`)
}
