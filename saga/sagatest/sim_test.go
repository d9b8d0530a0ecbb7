package sagatest_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

// The simulator needs no database nor broker: these tests run with
// MILLWRIGHT_TEST_* unset (go test -run Sim ./saga/sagatest/).

type simOrder struct {
	ID          string `json:"id"`
	Reservation string `json:"reservation,omitempty"`
}

// simDef is reserve (release; its success reply carries the reservation),
// charge (refund), ship (no compensation); each step times out after 10s,
// each compensation after 5s, and is tried 3 times, 1s then 2s apart.
func simDef(t *testing.T, mutate ...func(*[3]saga.Step[simOrder])) *saga.Definition[simOrder] {
	t.Helper()
	cmd := func(typ string) func(simOrder) (saga.Command, error) {
		return func(o simOrder) (saga.Command, error) {
			return saga.Command{Topic: "commands", Type: typ, Payload: o}, nil
		}
	}
	pol := retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute, MaxAttempts: 3}
	steps := [3]saga.Step[simOrder]{
		{Name: "reserve", Command: cmd("reserve.v1"), Compensation: cmd("release.v1"),
			OnSuccess: func(o *simOrder, r saga.Reply) error {
				var body struct{ Reservation string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.Reservation = body.Reservation
				return nil
			},
			Timeout: 10 * time.Second, CompensationTimeout: 5 * time.Second, Retry: pol},
		{Name: "charge", Command: cmd("charge.v1"), Compensation: cmd("refund.v1"),
			Timeout: 10 * time.Second, CompensationTimeout: 5 * time.Second, Retry: pol},
		{Name: "ship", Command: cmd("ship.v1"), NoCompensation: true, Timeout: 10 * time.Second},
	}
	for _, m := range mutate {
		m(&steps)
	}
	def, err := saga.Define("orders", steps[:]...)
	require.NoError(t, err)
	return def
}

func newSim(t *testing.T, def *saga.Definition[simOrder]) *sagatest.Simulator[simOrder] {
	t.Helper()
	sim, err := sagatest.NewSimulator(def)
	require.NoError(t, err)
	return sim
}

// kinds returns saga id's history as "step:kind" strings.
func kinds(sim *sagatest.Simulator[simOrder], id string) []string {
	var out []string
	for _, h := range sim.History(id) {
		out = append(out, h.Step+":"+h.Kind)
	}
	return out
}

func TestSimAllSucceed(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.Equal(t, saga.StateRunning, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1"}, sim.Trace("o-1"))

	// By hand: the reply's payload reaches the data through OnSuccess.
	require.NoError(t, sim.Reply("o-1", "reserve", "reserve.succeeded", map[string]string{"reservation": "r-9"}))
	data, err := sim.Data("o-1")
	require.NoError(t, err)
	require.Equal(t, simOrder{ID: "o-1", Reservation: "r-9"}, data)
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Equal(t, "charge", info.Step)
	require.Equal(t, sim.Now().Add(10*time.Second), info.Deadline)

	// The rest by the default script: every command succeeds.
	sim.ScriptPayload(func(c sagatest.Command) any {
		if c.Step == "reserve" {
			return map[string]string{"reservation": "r-" + c.SagaID}
		}
		return nil
	})
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompleted, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "ship/forward/1"}, sim.Trace("o-1"))
	require.Equal(t, []string{"reserve:command", "reserve:reply", "charge:command", "charge:reply", "ship:command", "ship:reply", "ship:completed"},
		kinds(sim, "o-1"))
	require.Equal(t, sagatest.SimEpoch, sim.Now(), "no deadline fired, no time passed")
	// A second saga, entirely by script: the payload reaches the data.
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.RunUntilIdle())
	data, err = sim.Data("o-2")
	require.NoError(t, err)
	require.Equal(t, simOrder{ID: "o-2", Reservation: "r-o-2"}, data)

	// Commands carry what the participant receives.
	cmds := sim.Sent("o-1")
	require.Equal(t, "commands", cmds[1].Topic)
	require.Equal(t, "charge.v1", cmds[1].Type)
	require.JSONEq(t, `{"id":"o-1","reservation":"r-9"}`, string(cmds[1].Payload))
	require.Equal(t, "orders_replies", saga.ReplyTopic(cmds[1].Message))
	require.Equal(t, "charge", cmds[1].Message.Metadata.Get(metadata.SagaStep))
}

func TestSimStepFailsCompensatesEarlierInReverse(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.OnStep("ship", sagatest.Fail))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())

	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "ship/forward/1",
		"charge/compensation/1", "reserve/compensation/1"}, sim.Trace("o-1"))
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Equal(t, `step "ship" failed: sagatest: scripted failure of ship/forward/1`, info.Cause)
	require.Equal(t, info.Cause, info.LastError)
	require.Equal(t, -1, info.StepIndex)
	require.Equal(t, "refund.v1", sim.Sent("o-1")[3].Type)

	// The same by hand, failing the first step: nothing to compensate.
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.Fail("o-2", "reserve", "out of stock"))
	require.Equal(t, saga.StateCompensated, sim.State("o-2"))
	require.Equal(t, []string{"reserve/forward/1"}, sim.Trace("o-2"))
	h := sim.History("o-2")
	require.Equal(t, "out of stock", h[1].Error)
}

func TestSimTimeoutCompensatesTheStepThenUndoesItsLateSuccess(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.Succeed("o-1", "reserve"))

	// Nothing fires before the deadline.
	require.NoError(t, sim.Advance(10*time.Second-time.Millisecond))
	require.Equal(t, saga.StateRunning, sim.State("o-1"))
	require.NoError(t, sim.Advance(time.Millisecond))
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	// The timed-out step's own compensation first: its effect is unknown.
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "charge/compensation/1"}, sim.Trace("o-1"))
	require.Equal(t, sagatest.SimEpoch.Add(10*time.Second), sim.Sent("o-1")[2].At)

	require.NoError(t, sim.Compensated("o-1", "charge"))
	require.NoError(t, sim.Compensated("o-1", "reserve"))
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))

	// The charge happened after all: it is undone again, in a new round.
	require.NoError(t, sim.Succeed("o-1", "charge"))
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	require.Equal(t, "charge/compensation/2", sim.Trace("o-1")[4])
	require.NoError(t, sim.Compensated("o-1", "charge"))
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, []string{"reserve:command", "reserve:reply", "charge:command", "charge:timeout", "charge:compensation",
		"charge:compensation_reply", "reserve:compensation", "reserve:compensation_reply", ":compensated",
		"charge:late_success", "charge:compensation", "charge:compensation_reply", ":compensated"}, kinds(sim, "o-1"))

	// A second delivery of the late success sends nothing again.
	require.NoError(t, sim.Succeed("o-1", "charge"))
	require.Len(t, sim.Sent("o-1"), 5)
	require.Equal(t, saga.KindDuplicate, sim.History("o-1")[13].Kind)
}

func TestSimSilentStepRunsToCompensated(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.OnStep("charge", sagatest.Silent))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "charge/compensation/1", "reserve/compensation/1"}, sim.Trace("o-1"))
	require.Equal(t, sagatest.SimEpoch.Add(10*time.Second), sim.Now(), "the clock jumped to the timeout")
}

func TestSimCompensationFailsUntilBudgetThenStuck(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.OnStep("ship", sagatest.Fail))
	require.NoError(t, sim.OnCompensation("charge", sagatest.Fail))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.RunUntilIdle())

	require.Equal(t, saga.StateStuck, sim.State("o-1"))
	cmds := sim.Sent("o-1")
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1", "ship/forward/1",
		"charge/compensation/1", "charge/compensation/2", "charge/compensation/3"}, sim.Trace("o-1"))
	// Retried after the step's backoff (1s, then 2s: no jitter here).
	require.Equal(t, time.Second, cmds[4].At.Sub(cmds[3].At))
	require.Equal(t, 2*time.Second, cmds[5].At.Sub(cmds[4].At))
	info, err := sim.Info("o-1")
	require.NoError(t, err)
	require.Contains(t, info.LastError, `compensation of step "charge" failed (attempt 3)`)
	require.Equal(t, time.Time{}, info.Deadline, "a stuck saga waits for an operator")
	h := sim.History("o-1")
	require.Equal(t, saga.KindStuck, h[len(h)-1].Kind)

	// Unanswered compensations count as failed attempts too.
	sim = newSim(t, simDef(t))
	require.NoError(t, sim.OnStep("ship", sagatest.Fail))
	require.NoError(t, sim.OnCompensation("charge", sagatest.Silent))
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateStuck, sim.State("o-2"))
	require.Len(t, sim.Sent("o-2"), 6)
	// 3 timeouts of 5s and the backoffs of 1s and 2s between them.
	require.Equal(t, sagatest.SimEpoch.Add(18*time.Second), sim.Now())
}

func TestSimDuplicateAndLateRepliesRecordedAndIgnored(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.Succeed("o-1", "reserve"))
	reserve := sim.Sent("o-1")[0]

	// The participant answers the same command twice: a duplicate.
	require.NoError(t, sim.ReplyTo(reserve, "reserve.succeeded", nil))
	// And then, contradicting itself, a failure: a duplicate too (the
	// command was answered).
	require.NoError(t, sim.ReplyTo(reserve, "reserve.failed", nil))
	require.Equal(t, saga.StateRunning, sim.State("o-1"))
	require.Equal(t, []string{"reserve/forward/1", "charge/forward/1"}, sim.Trace("o-1"))

	// charge times out; its failure comes afterwards: late, ignored.
	require.NoError(t, sim.Advance(10*time.Second))
	require.NoError(t, sim.Fail("o-1", "charge", "card declined"))
	// A reply to an attempt of the compensation that was never sent.
	require.NoError(t, sim.ReplyTo(sagatest.Command{SagaID: "o-1", Step: "charge", Phase: saga.PhaseCompensation, Attempt: 2}, "charge.compensated", nil))
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	require.Len(t, sim.Sent("o-1"), 3)

	h := sim.History("o-1")
	got := map[string]int{}
	for _, r := range h {
		got[r.Kind]++
	}
	require.Equal(t, 2, got[saga.KindDuplicate])
	require.Equal(t, 2, got[saga.KindLateReply])
	require.Equal(t, 1, got[saga.KindTimeout])
}

func TestSimErrorsNameWhatIsWrong(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))

	err := sim.Start("o-1", simOrder{ID: "o-1"})
	require.ErrorIs(t, err, saga.ErrAlreadyStarted)
	require.ErrorContains(t, sim.Start("", simOrder{}), "empty saga id")

	err = sim.Succeed("o-404", "reserve")
	require.ErrorIs(t, err, saga.ErrNotFound)
	require.ErrorContains(t, err, `"o-404"`)
	_, err = sim.Info("o-404")
	require.ErrorIs(t, err, saga.ErrNotFound)
	require.Equal(t, saga.State(""), sim.State("o-404"))
	require.Nil(t, sim.History("o-404"))

	require.ErrorContains(t, sim.Succeed("o-1", "reserv"), `unknown step "reserv": want one of reserve, charge, ship`)
	require.ErrorContains(t, sim.Reply("o-1", "reserve", "reserve.done", nil),
		`step "reserve" has no reply type "reserve.done": want "reserve.succeeded", "reserve.failed" (its command) or "reserve.compensated", "reserve.compensation_failed"`)
	require.ErrorContains(t, sim.Succeed("o-1", "charge"), `no forward command of step "charge" was sent`)
	require.ErrorContains(t, sim.Compensated("o-1", "reserve"), `no compensation command of step "reserve" was sent`)
	err = sim.ReplyTo(sim.Sent("o-1")[0], "reserve.compensated", nil)
	require.ErrorContains(t, err, `want "reserve.succeeded" or "reserve.failed"`)
	require.ErrorContains(t, sim.OnStep("nope", sagatest.Fail), `unknown step "nope"`)
	require.ErrorContains(t, sim.OnCompensation("reserve", sagatest.Answer(7)), "want Succeed, Fail or Silent")
	require.ErrorContains(t, sim.Advance(-time.Second), "only moves forward")
	// None of it changed the saga.
	require.Equal(t, []string{"reserve:command"}, kinds(sim, "o-1"))

	_, err = sagatest.NewSimulator[simOrder](nil)
	require.ErrorContains(t, err, "definition is nil")
	_, err = sagatest.NewSimulator(simDef(t), sagatest.WithConfig(saga.Config{ReplyShards: 100}))
	require.ErrorContains(t, err, "ReplyShards 100")

	// OnSuccess refusing the reply: the error is returned, nothing moves
	// (the orchestrator would have the reply redelivered).
	err = sim.Reply("o-1", "reserve", "reserve.succeeded", "not an object")
	require.ErrorContains(t, err, `step "reserve" OnSuccess`)
	require.Equal(t, []string{"reserve/forward/1"}, sim.Trace("o-1"))
}

func TestSimRunUntilIdleGivesUpOnEndlessRetries(t *testing.T) {
	t.Parallel()
	def := simDef(t, func(s *[3]saga.Step[simOrder]) { s[0].Retry.MaxAttempts = -1 })
	sim := newSim(t, def)
	require.NoError(t, sim.OnStep("charge", sagatest.Fail))
	require.NoError(t, sim.OnCompensation("reserve", sagatest.Fail))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	err := sim.RunUntilIdle()
	require.ErrorContains(t, err, "still busy after 10000")
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
}

func TestSimPanickingCompensationIsSetAside(t *testing.T) {
	t.Parallel()
	def := simDef(t, func(s *[3]saga.Step[simOrder]) {
		s[1].Compensation = func(simOrder) (saga.Command, error) { panic("refund: nil map") }
	})
	sim := newSim(t, def)
	// On a reply, the panic is the reply's error, as HandleReply's (a
	// failure.Permanent one there): nothing moves.
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	require.NoError(t, sim.Succeed("o-1", "reserve"))
	require.NoError(t, sim.Succeed("o-1", "charge"))
	err := sim.Fail("o-1", "ship", "no truck")
	require.ErrorContains(t, err, "refund: nil map")
	require.Equal(t, saga.StateRunning, sim.State("o-1"))

	// At a deadline, Run sets the instance aside as stuck, naming the
	// panic, and the other sagas go on.
	require.NoError(t, sim.Start("o-2", simOrder{ID: "o-2"}))
	require.NoError(t, sim.Succeed("o-2", "reserve"))
	require.NoError(t, sim.Advance(10*time.Second))
	require.Equal(t, saga.StateStuck, sim.State("o-2"))
	info, err := sim.Info("o-2")
	require.NoError(t, err)
	require.Contains(t, info.LastError, "set aside")
	require.Contains(t, info.LastError, "refund: nil map")
	require.Equal(t, saga.StateStuck, sim.State("o-1"), "ship timed out too")
}

func TestSimParticipantHandlerReplies(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	// A participant's own code answers the command's message.
	cmd := sim.Sent("o-1")[0]
	reply, err := saga.NewReply(cmd.Message, "reserve.succeeded", map[string]string{"reservation": "r-1"})
	require.NoError(t, err)
	require.NoError(t, sim.HandleReply(reply))
	data, err := sim.Data("o-1")
	require.NoError(t, err)
	require.Equal(t, "r-1", data.Reservation)
	// Answered: RunUntilIdle does not hand it to the script again.
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, []string{"reserve:command", "reserve:reply", "charge:command", "charge:reply", "ship:command", "ship:reply", "ship:completed"},
		kinds(sim, "o-1"))

	// A reply of another saga type is refused, as HandleReply refuses it.
	reply.Metadata.Set(metadata.SagaType, "payments")
	require.ErrorContains(t, sim.HandleReply(reply), `is for saga type "payments"`)
}

func TestSimIsDeterministic(t *testing.T) {
	t.Parallel()
	run := func() ([]saga.HistoryEntry, []sagatest.Command) {
		sim := newSim(t, simDef(t))
		sim.Script(func(c sagatest.Command) sagatest.Answer {
			switch {
			case c.Step == "ship":
				return sagatest.Silent
			case c.Step == "charge" && c.Phase == saga.PhaseCompensation && c.Attempt < 3:
				return sagatest.Fail
			}
			return sagatest.Succeed
		})
		for _, id := range []string{"a", "b", "c"} {
			require.NoError(t, sim.Start(id, simOrder{ID: id}))
			require.NoError(t, sim.Advance(time.Second))
		}
		require.NoError(t, sim.RunUntilIdle())
		var all []saga.HistoryEntry
		for _, id := range []string{"a", "b", "c"} {
			require.Equal(t, saga.StateCompensated, sim.State(id))
			all = append(all, sim.History(id)...)
		}
		return all, sim.Commands()
	}
	h1, c1 := run()
	h2, c2 := run()
	require.Equal(t, h1, h2)
	require.Equal(t, len(c1), len(c2))
	for i := range c1 {
		require.Equal(t, c1[i].String()+c1[i].At.String(), c2[i].String()+c2[i].At.String())
	}
}

func TestSimResolveStuck(t *testing.T) {
	t.Parallel()
	sim := newSim(t, simDef(t))
	require.NoError(t, sim.OnStep("ship", sagatest.Fail))
	require.NoError(t, sim.OnCompensation("charge", sagatest.Fail))
	require.NoError(t, sim.Start("o-1", simOrder{ID: "o-1"}))
	_, err := sim.Resolve("o-1", saga.ResolveRetry, "")
	require.ErrorIs(t, err, saga.ErrNotStuck)
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateStuck, sim.State("o-1"))

	// The participant is fixed; the operator retries.
	require.NoError(t, sim.OnCompensation("charge", sagatest.Succeed))
	res, err := sim.Resolve("o-1", saga.ResolveRetry, "gateway fixed")
	require.NoError(t, err)
	require.Contains(t, res.Description, `resend the compensation of step "charge"`)
	require.Equal(t, saga.StateCompensating, sim.State("o-1"))
	require.NoError(t, sim.RunUntilIdle())
	require.Equal(t, saga.StateCompensated, sim.State("o-1"))
	trace := sim.Trace("o-1")
	require.Equal(t, []string{"charge/compensation/4", "reserve/compensation/1"}, trace[len(trace)-2:])
	h := sim.History("o-1")
	var resolved []saga.HistoryEntry
	for _, e := range h {
		if e.Kind == saga.KindResolved {
			resolved = append(resolved, e)
		}
	}
	require.Equal(t, []saga.HistoryEntry{{Step: "charge", Kind: saga.KindResolved, Detail: "retry: gateway fixed", Attempt: 3, At: sim.Now()}}, resolved)

	_, err = sim.Resolve("o-404", saga.ResolveSkip, "")
	require.ErrorIs(t, err, saga.ErrNotFound)
	_, err = sim.Resolve("o-1", "undo", "")
	require.ErrorContains(t, err, `unknown action "undo"`)
}
