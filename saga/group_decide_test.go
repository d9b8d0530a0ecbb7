package saga

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
)

// The decisions on parallel branches, pure (no database).

// groupDef is reserve, then the group pay of charge (10s, refund; its
// command fails for a negative amount) and points (20s, unpoint), then
// ship (no compensation).
func groupDef(t *testing.T) decider[order] {
	t.Helper()
	cmd := func(topic, typ string) func(order) (Command, error) {
		return func(o order) (Command, error) { return Command{Topic: topic, Type: typ, Payload: o}, nil }
	}
	def, err := Define("orders",
		Step[order]{Name: "reserve", Command: cmd("inventory", "reserve.v1"), Compensation: cmd("inventory", "release.v1"), Timeout: 10 * time.Second},
		Step[order]{Name: "pay", Parallel: []Step[order]{
			{Name: "charge",
				Command: func(o order) (Command, error) {
					if o.Amount < 0 {
						return Command{}, errors.New("negative amount")
					}
					return Command{Topic: "payment", Type: "charge.v1", Payload: o}, nil
				},
				OnSuccess: func(o *order, r Reply) error {
					o.PaymentID = string(r.Payload)
					return nil
				},
				Compensation: func(o order) (Command, error) {
					return Command{Topic: "payment", Type: "refund.v1", Payload: map[string]string{"payment": o.PaymentID}}, nil
				},
				Timeout: 10 * time.Second},
			{Name: "points", Command: cmd("loyalty", "points.v1"), Compensation: cmd("loyalty", "unpoint.v1"), Timeout: 20 * time.Second},
		}},
		Step[order]{Name: "ship", Command: cmd("shipping", "ship.v1"), NoCompensation: true, Timeout: 10 * time.Second},
	)
	require.NoError(t, err)
	cfg := Config{}
	cfg.setDefaults(def.name)
	return decider[order]{def: def, cfg: cfg}
}

// decideAt decides inp at now with the history loaded (h.answered as
// given) and requires a transition whose instance is then the input of
// the next one.
func decideAt(t *testing.T, d decider[order], in instance, inp input, answered bool, now time.Time) *transition {
	t.Helper()
	tr, err := d.decide(in, inp, history{loaded: true, answered: answered}, now)
	require.NoError(t, err)
	if tr.in.version != 0 {
		tr.in.version++ // as written
	}
	return tr
}

func fwd(d decider[order], step, typ, payload string) input {
	return input{reply: reply(d, step, PhaseForward, 1, typ, payload)}
}

func comp(d decider[order], step, typ string, attempt int) input {
	return input{reply: reply(d, step, PhaseCompensation, attempt, typ, "")}
}

var deadline = input{deadline: true}

// inGroup is saga o-1 right after reserve succeeded: the group entered.
func inGroup(t *testing.T, d decider[order]) *transition {
	t.Helper()
	tr := decideAt(t, d, running(0, `{"id":"o-1","amount":42}`), fwd(d, "reserve", "reserve.succeeded", ""), false, t0)
	require.Equal(t, []string{"reserve:reply:1", "charge:command:1", "points:command:1"}, kinds(tr))
	require.Equal(t, []string{"charge/forward/1 charge.v1", "points/forward/1 points.v1"}, commands(tr), "every branch's command in one transition")
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, t0.Add(10*time.Second), tr.in.deadline.Time, "the earliest branch deadline")
	require.Equal(t, map[string]BranchInfo{
		"charge": {State: BranchRunning, Deadline: t0.Add(10 * time.Second)},
		"points": {State: BranchRunning, Deadline: t0.Add(20 * time.Second)},
	}, tr.in.branches)
	return tr
}

// compensateAll answers every compensation tr sends, from tr on, until the
// saga is compensated, and returns the compensated steps in order.
func compensateAll(t *testing.T, d decider[order], tr *transition) []string {
	t.Helper()
	var undone []string
	for range 10 {
		if tr.in.state == StateCompensated {
			return undone
		}
		require.Equal(t, StateCompensating, tr.in.state, kinds(tr))
		require.Len(t, tr.events, 1, kinds(tr))
		s := tr.events[0].Metadata[metadata.SagaStep]
		undone = append(undone, s)
		tr = decideAt(t, d, tr.in, comp(d, s, s+".compensated", tr.in.attempt()), false, t0)
	}
	t.Fatalf("not compensated after %v", undone)
	return nil
}

func TestDecideGroupAllSucceed(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)

	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0)
	require.Equal(t, []string{"points:reply:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, t0.Add(10*time.Second), tr.in.deadline.Time, "charge's deadline")

	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0)
	require.Equal(t, []string{"charge:reply:1", "ship:command:1"}, kinds(tr))
	require.Equal(t, []string{"ship/forward/1 ship.v1"}, commands(tr))
	require.Equal(t, d.def.index["ship"], tr.in.step)
	require.JSONEq(t, `{"id":"o-1","amount":42,"payment_id":"p-7"}`, string(tr.in.data), "the branch's OnSuccess ran")
	require.Equal(t, BranchSucceeded, tr.in.branches["charge"].State)
	require.Equal(t, BranchSucceeded, tr.in.branches["points"].State)

	// A redelivered branch reply is a duplicate, recorded only.
	dup := decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), true, t0)
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(dup))
	require.Empty(t, dup.events)

	tr = decideAt(t, d, tr.in, fwd(d, "ship", "ship.succeeded", ""), false, t0)
	require.Equal(t, StateCompleted, tr.in.state)
}

// A group as the last step completes the saga.
func TestDecideGroupLastCompletes(t *testing.T) {
	cmd := func(struct{}) (Command, error) { return Command{Topic: "t"}, nil }
	def := MustDefine("x", Step[struct{}]{Name: "g", Parallel: []Step[struct{}]{
		{Name: "a", Command: cmd, NoCompensation: true}, {Name: "b", Command: cmd, NoCompensation: true}}})
	d := decider[struct{}]{def: def, cfg: Config{ReplyTopic: "x_replies"}}
	tr, err := d.decideStart("x-1", struct{}{}, t0)
	require.NoError(t, err)
	require.Len(t, tr.events, 2, "the group as first step sends both at the start")
	in := tr.in
	in.version = 1
	for _, b := range []string{"a", "b"} {
		tr, err = d.decide(in, input{reply: replyInfo{sagaID: "x-1", step: b, stepIdx: def.index[b], phase: PhaseForward, attempt: 1,
			reply: Reply{Type: b + ".succeeded"}}}, history{}, t0)
		require.NoError(t, err, "a branch success needs no history")
		in = tr.in
	}
	require.Equal(t, StateCompleted, in.state)
	require.Equal(t, []string{"b:reply:1", "b:completed:0"}, kinds(tr))
}

// One branch fails while the other is in flight: the other is awaited,
// then exactly the branch that succeeded is compensated, then the steps
// before the group.
func TestDecideGroupFailureAwaitsTheRunningBranch(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	failure := fwd(d, "charge", "charge.failed", "card declined")
	tr = decideAt(t, d, tr.in, failure, false, t0)
	require.Equal(t, []string{"charge:reply:1"}, kinds(tr))
	require.Empty(t, tr.events, "nothing is compensated while points is in flight")
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, t0.Add(20*time.Second), tr.in.deadline.Time, "points' deadline")
	require.Equal(t, `group "pay" branch "charge" failed: card declined`, tr.in.cause.String)

	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0)
	require.Equal(t, []string{"points:reply:1", "points:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"points", "reserve"}, compensateAll(t, d, tr), "charge failed: nothing to undo")
}

// The same when the failure comes last: compensation starts at once.
func TestDecideGroupFailureAfterTheOtherSucceeded(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0)
	require.Empty(t, tr.events)
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.failed", "closed"), false, t0)
	require.Equal(t, []string{"points:reply:1", "charge:compensation:1"}, kinds(tr))
	require.JSONEq(t, `{"payment":"p-7"}`, string(tr.events[0].Payload))
	require.Equal(t, []string{"charge", "reserve"}, compensateAll(t, d, tr))
}

// Both fail: only the steps before the group are compensated; the second
// failure is added to last_error.
func TestDecideGroupBothFail(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.failed", "declined"), false, t0)
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.failed", "closed"), false, t0)
	require.Contains(t, tr.in.lastError.String, `branch "points" failed: closed`)
	require.Equal(t, `group "pay" branch "charge" failed: declined`, tr.in.cause.String)
	require.Equal(t, []string{"reserve"}, compensateAll(t, d, tr))
}

// A branch times out at its own deadline; the other is awaited; the
// timed-out branch (effect unknown) is compensated with the one that
// succeeded.
func TestDecideGroupBranchTimesOut(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	// The instance's deadline passed by the database's clock: charge is
	// due even if the orchestrator's clock is behind; points is not.
	tr = decideAt(t, d, tr.in, deadline, false, t0.Add(5*time.Second))
	require.Equal(t, []string{"charge:timeout:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.True(t, tr.has(noteTimeout))
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, BranchTimedOut, tr.in.branches["charge"].State)
	require.Equal(t, t0.Add(20*time.Second), tr.in.deadline.Time, "points is awaited")
	require.Equal(t, `group "pay" branch "charge" timed out after 10s`, tr.in.cause.String)

	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0.Add(11*time.Second))
	require.Equal(t, []string{"points", "charge", "reserve"}, compensateAll(t, d, tr))
}

// Both branches time out together.
func TestDecideGroupBothTimeOut(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, deadline, false, t0.Add(time.Minute))
	require.Equal(t, []string{"charge:timeout:1", "points:timeout:1", "points:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"points", "charge", "reserve"}, compensateAll(t, d, tr))
}

// A timed-out branch's success while the other still runs: recorded as a
// late success; it is compensated once, with the others, when the group
// settles.
func TestDecideGroupLateSuccessWhileTheGroupRuns(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, deadline, false, t0.Add(10*time.Second))
	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0.Add(11*time.Second))
	require.Equal(t, []string{"charge:late_success:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.True(t, tr.has(noteLateSuccess))
	require.JSONEq(t, `{"id":"o-1","amount":42,"payment_id":"p-7"}`, string(tr.in.data), "OnSuccess ran: the refund needs it")
	dup := decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), true, t0.Add(11*time.Second))
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(dup), "its redelivery")
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0.Add(12*time.Second))
	require.Equal(t, []string{"points", "charge", "reserve"}, compensateAll(t, d, tr), "charge once")
}

// A timed-out branch's success after the saga was compensated is undone
// as any late success: its compensation is sent again.
func TestDecideGroupLateSuccessAfterCompensation(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, deadline, false, t0.Add(10*time.Second))
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.failed", "closed"), false, t0.Add(11*time.Second))
	require.Equal(t, []string{"points:reply:1", "charge:compensation:1"}, kinds(tr), "points failed: only charge (timed out), then reserve")
	in := tr.in
	for _, s := range []string{"charge", "reserve"} {
		tr = decideAt(t, d, in, comp(d, s, s+".compensated", in.attempt()), false, t0)
		in = tr.in
	}
	require.Equal(t, StateCompensated, in.state)

	tr = decideAt(t, d, in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0.Add(time.Minute))
	require.Equal(t, []string{"charge:late_success:1", "charge:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"charge/compensation/1 refund.v1"}, commands(tr))
	require.Equal(t, StateCompensating, tr.in.state)

	// points failed: its success (impossible, or forged) is no late
	// success to undo.
	tr = decideAt(t, d, in, fwd(d, "points", "points.succeeded", ""), true, t0.Add(time.Minute))
	require.Equal(t, []string{"points:duplicate:1"}, kinds(tr))
	require.Empty(t, tr.events)
}

// A later step's failure compensates every branch of the completed group,
// last declared first, then the steps before it.
func TestDecideGroupLaterFailureCompensatesEveryBranch(t *testing.T) {
	d := groupDef(t)
	tr := inGroup(t, d)
	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0)
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0)
	tr = decideAt(t, d, tr.in, fwd(d, "ship", "ship.failed", "no truck"), false, t0)
	require.Equal(t, []string{"ship:reply:1", "points:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"points", "charge", "reserve"}, compensateAll(t, d, tr))

	// And its timeout.
	tr = inGroup(t, d)
	tr = decideAt(t, d, tr.in, fwd(d, "charge", "charge.succeeded", "p-7"), false, t0)
	tr = decideAt(t, d, tr.in, fwd(d, "points", "points.succeeded", ""), false, t0)
	tr = decideAt(t, d, tr.in, deadline, false, t0.Add(time.Hour))
	require.Equal(t, []string{"ship:timeout:1", "points:compensation:1"}, kinds(tr), "ship has nothing to undo")
	require.Equal(t, []string{"points", "charge", "reserve"}, compensateAll(t, d, tr))
}

// A branch whose command cannot be built sends none of the group's
// commands: the saga fails at the group.
func TestDecideGroupCommandErrorSendsNoBranch(t *testing.T) {
	d := groupDef(t)
	tr := decideAt(t, d, running(0, `{"id":"o-1","amount":-1}`), fwd(d, "reserve", "reserve.succeeded", ""), false, t0)
	require.Equal(t, []string{"reserve:reply:1", "charge:command:1", "reserve:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"reserve/compensation/1 release.v1"}, commands(tr))
	require.Contains(t, tr.in.cause.String, `group "pay" branch "charge": building command: negative amount`)
	require.Empty(t, tr.in.branches)
}

// An instance at a group without its branches' state is refused, never
// taken for a group whose branches all answered.
func TestDecideGroupWithoutBranchStateIsRefused(t *testing.T) {
	d := groupDef(t)
	in := running(d.def.index["charge"], `{}`)
	_, err := d.decide(in, fwd(d, "charge", "charge.succeeded", ""), loaded, t0)
	require.ErrorIs(t, err, ErrUnknownPosition)
	_, err = d.decide(in, deadline, loaded, t0.Add(time.Hour))
	require.ErrorIs(t, err, ErrUnknownPosition)
}

// Every outcome of a three-branch group (each branch succeeds, fails or
// times out), in every order of the answers: nothing is compensated while
// a branch runs; then exactly the branches with a Compensation that
// succeeded or timed out are compensated, once each, last declared first,
// then reserve; with all succeeded, ship is next.
func TestDecideGroupEveryOutcomeAndOrder(t *testing.T) {
	cmd := func(topic string) func(order) (Command, error) {
		return func(order) (Command, error) { return Command{Topic: topic, Type: topic + ".v1"}, nil }
	}
	def, err := Define("orders",
		Step[order]{Name: "reserve", Command: cmd("inventory"), Compensation: cmd("inventory")},
		Step[order]{Name: "g", Parallel: []Step[order]{
			{Name: "a", Command: cmd("a"), Compensation: cmd("a"), Timeout: 10 * time.Second},
			{Name: "b", Command: cmd("b"), Compensation: cmd("b"), Timeout: 10 * time.Second},
			{Name: "c", Command: cmd("c"), NoCompensation: true, Timeout: 10 * time.Second},
		}},
		Step[order]{Name: "ship", Command: cmd("shipping"), NoCompensation: true},
	)
	require.NoError(t, err)
	cfg := Config{}
	cfg.setDefaults(def.name)
	d := decider[order]{def: def, cfg: cfg}
	outcomes := []string{"succeeded", "failed", "timeout"}
	perms := [][]string{{"a", "b", "c"}, {"a", "c", "b"}, {"b", "a", "c"}, {"b", "c", "a"}, {"c", "a", "b"}, {"c", "b", "a"}}
	for _, oa := range outcomes {
		for _, ob := range outcomes {
			for _, oc := range outcomes {
				out := map[string]string{"a": oa, "b": ob, "c": oc}
				for _, perm := range perms {
					name := oa + "/" + ob + "/" + oc + " answered " + perm[0] + perm[1] + perm[2]
					// The answers of the branches that do not time out,
					// in perm's order, then their deadline if any does.
					var inputs []input
					for _, b := range perm {
						if out[b] != "timeout" {
							inputs = append(inputs, input{reply: reply(d, b, PhaseForward, 1, b+"."+out[b], "")})
						}
					}
					if len(inputs) < 3 {
						inputs = append(inputs, deadline)
					}
					tr := decideAt(t, d, running(0, `{}`), input{reply: reply(d, "reserve", PhaseForward, 1, "reserve.succeeded", "")}, false, t0)
					require.Len(t, tr.events, 3, name)
					for j, inp := range inputs {
						tr = decideAt(t, d, tr.in, inp, false, t0.Add(10*time.Second))
						if j < len(inputs)-1 {
							require.Empty(t, tr.events, "%s: sent while a branch runs", name)
							require.Equal(t, StateRunning, tr.in.state, name)
						}
					}
					if oa == "succeeded" && ob == "succeeded" && oc == "succeeded" {
						require.Equal(t, []string{"ship/forward/1 shipping.v1"}, commands(tr), name)
						continue
					}
					var want []string
					for _, b := range []string{"b", "a"} { // c has no compensation
						if out[b] != "failed" {
							want = append(want, b)
						}
					}
					want = append(want, "reserve")
					require.Equal(t, want, compensateAll(t, d, tr), name)
				}
			}
		}
	}
}
