package saga

import (
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
)

// Versions without a database: the step graph's fingerprint, the diff
// that names a change, the version routing and the migration plan.

func vstep(name string, comp bool) Step[order] {
	cmd := func(order) (Command, error) { return Command{Topic: "t", Type: name}, nil }
	s := Step[order]{Name: name, Command: cmd}
	if comp {
		s.Compensation = cmd
	} else {
		s.NoCompensation = true
	}
	return s
}

func vdef(t *testing.T, version int, steps ...Step[order]) *Definition[order] {
	t.Helper()
	d, err := DefineVersion("order", version, steps...)
	require.NoError(t, err)
	return d
}

func TestVersionsFingerprintIsTheStepGraph(t *testing.T) {
	t.Parallel()
	a := vdef(t, 1, vstep("reserve", true), vstep("charge", true))
	b := vdef(t, 2, vstep("reserve", true), vstep("charge", true))
	require.Equal(t, 1, a.Version())
	require.Equal(t, 2, b.Version())
	require.Equal(t, a.Fingerprint(), b.Fingerprint(), "the version number is not part of the graph")
	slow := vstep("charge", true)
	slow.Timeout, slow.Retry.MaxAttempts = time.Hour, 9
	require.Equal(t, a.Fingerprint(), vdef(t, 1, vstep("reserve", true), slow).Fingerprint(), "timeouts and retries are safe to change")
	require.NotEqual(t, a.Fingerprint(), vdef(t, 1, vstep("reserve", true), vstep("fraud_check", false), vstep("charge", true)).Fingerprint())
	require.NotEqual(t, a.Fingerprint(), vdef(t, 1, vstep("reserve", true), vstep("charge", false)).Fingerprint())
	renamed := vstep("charge", true)
	renamed.SuccessReply = "charged"
	require.NotEqual(t, a.Fingerprint(), vdef(t, 1, vstep("reserve", true), renamed).Fingerprint())
	d, err := Define("order", vstep("reserve", true))
	require.NoError(t, err)
	require.Equal(t, 1, d.Version(), "Define is version 1")
	_, err = DefineVersion("order", 0, vstep("reserve", true))
	require.ErrorContains(t, err, "version must be 1 or more")
}

func TestVersionsGraphChangesNameTheStep(t *testing.T) {
	t.Parallel()
	base := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", false)).graph()
	for _, c := range []struct {
		name  string
		steps []Step[order]
		want  []string
	}{
		{"inserted", []Step[order]{vstep("reserve", true), vstep("fraud_check", false), vstep("charge", true), vstep("ship", false)},
			[]string{`step "fraud_check" inserted before "charge"`}},
		{"appended", []Step[order]{vstep("reserve", true), vstep("charge", true), vstep("ship", false), vstep("notify", false)},
			[]string{`step "notify" inserted at the end`}},
		{"removed", []Step[order]{vstep("reserve", true), vstep("ship", false)},
			[]string{`step "charge" removed (it came before "ship")`}},
		{"removed last", []Step[order]{vstep("reserve", true), vstep("charge", true)},
			[]string{`step "ship" removed (it came last)`}},
		{"renamed", []Step[order]{vstep("reserve", true), vstep("pay", true), vstep("ship", false)},
			[]string{`step "charge" renamed to "pay"`}},
		{"reordered", []Step[order]{vstep("charge", true), vstep("reserve", true), vstep("ship", false)},
			[]string{`steps reordered: reserve, charge, ship became charge, reserve, ship`}},
		{"compensation dropped", []Step[order]{vstep("reserve", true), vstep("charge", false), vstep("ship", false)},
			[]string{`step "charge" changed: compensation yes became no, compensated "charge.compensated" removed, compensation_failed "charge.compensation_failed" removed`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, graphChanges(base, vdef(t, 1, c.steps...).graph()))
		})
	}
	require.Empty(t, graphChanges(base, base))
	require.Equal(t, []string{`the step graph changed: "group g" became ""`}, graphChanges(base+"group g\n", base),
		"a line other helpers add is compared too")
}

func TestVersionsConfigIsChecked(t *testing.T) {
	t.Parallel()
	v1 := vdef(t, 1, vstep("reserve", true), vstep("charge", true))
	v2 := vdef(t, 2, vstep("reserve", true), vstep("fraud_check", false), vstep("charge", true))
	other, err := DefineVersion("invoice", 1, vstep("reserve", true))
	require.NoError(t, err)
	_, err = newVersionSet(v2, Config{Versions: []Versioned{other, vdef(t, 2, vstep("x", true)), nil}})
	require.ErrorContains(t, err, `Config.Versions[0] is saga "invoice" version 1`)
	require.ErrorContains(t, err, `Config.Versions[1] is version 2, which is already registered`)
	require.ErrorContains(t, err, `Config.Versions[2] is nil`)
	v3 := vdef(t, 3, vstep("reserve", true))
	_, err = newVersionSet(v2, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v3, v2, keep), {}, Migrate(v2, v2, keep)}})
	require.ErrorContains(t, err, "Config.Migrations[0]: version 3 is not the orchestrator's definition nor in Config.Versions")
	require.ErrorContains(t, err, "Config.Migrations[1] is empty")
	require.ErrorContains(t, err, "Config.Migrations[2] migrates version 2 to itself")
	vs, err := newVersionSet(v2, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v1, v2, keep)}})
	require.NoError(t, err)
	require.Equal(t, []int64{1, 2}, vs.nums)
}

func keep(o order, at Position) (order, Position, error) { return o, at, nil }

func TestVersionsEachInstanceIsDecidedByItsOwnVersion(t *testing.T) {
	t.Parallel()
	v1 := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", false))
	v2 := vdef(t, 2, vstep("reserve", true), vstep("fraud_check", true), vstep("charge", true), vstep("ship", false))
	vs, err := newVersionSet(v2, Config{Versions: []Versioned{v1}})
	require.NoError(t, err)
	in := running(2, `{"id":"o-1"}`) // v1: waiting on ship
	in.defVersion, in.fingerprint = 1, sql.NullString{String: v1.Fingerprint(), Valid: true}
	d, err := vs.decider(in)
	require.NoError(t, err)
	tr, err := d.decide(in, input{deadline: true}, history{loaded: true}, t0)
	require.NoError(t, err)
	// v1's step 2 is ship (no compensation): its timeout compensates
	// charge, never v2's fraud_check.
	require.Equal(t, StateCompensating, tr.in.state)
	require.Len(t, tr.events, 1)
	require.Equal(t, "charge", tr.events[0].Metadata[metadata.SagaStep])

	in.defVersion = 3
	_, err = vs.decider(in)
	require.ErrorIs(t, err, ErrVersionNotRegistered)
	require.ErrorContains(t, err, "register version 3's definition in saga.Config.Versions")

	in.defVersion, in.fingerprint = 1, sql.NullString{String: "0123456789abcdef", Valid: true}
	_, err = vs.decider(in)
	require.ErrorIs(t, err, ErrDefinitionChanged)

	in.fingerprint = sql.NullString{} // from before versions: not checked
	_, err = vs.decider(in)
	require.NoError(t, err)
}

func TestMigrationPlanPlacesOnlyInstancesWaitingForward(t *testing.T) {
	t.Parallel()
	v1 := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", false))
	v2 := vdef(t, 2, vstep("reserve", true), vstep("fraud_check", false), vstep("charge", true), vstep("ship", false))
	refuse := func(o order, at Position) (order, Position, error) {
		if o.Amount > 100 {
			return o, at, errors.New("too large for the fraud rules")
		}
		if o.ID == "elsewhere" {
			return o, Position{Step: "ship"}, nil
		}
		o.PaymentID = "migrated"
		return o, at, nil
	}
	vs, err := newVersionSet(v2, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v1, v2, refuse)}})
	require.NoError(t, err)
	o := &Orchestrator[order]{def: v2, vs: vs}
	m := vs.migs[0]
	at := func(step int, data string) instance {
		in := running(step, data)
		in.defVersion, in.fingerprint = 1, sql.NullString{String: v1.Fingerprint(), Valid: true}
		return in
	}

	p := o.planOne(m, at(1, `{"id":"o-1","amount":42}`))
	require.Equal(t, MigrationPlan{SagaID: "o-1", State: StateRunning, FromVersion: 1, FromStep: "charge", ToVersion: 2, ToStep: "charge",
		Next: `sends nothing now; waits for the reply to step "charge"'s command already sent, then sends step "ship"'s command (version 2)`}, p.plan)
	require.Equal(t, 2, p.row.Step, "charge is index 2 in version 2")
	require.JSONEq(t, `{"id":"o-1","amount":42,"payment_id":"migrated"}`, string(p.row.Data))
	require.Equal(t, v2.Fingerprint(), p.row.DefFingerprint.String)

	stays := map[string]instance{
		"the migration refused it: too large":         at(1, `{"id":"o-1","amount":420}`),
		`the command of step "charge" is in flight`:   at(1, `{"id":"elsewhere"}`),
		`compensating (step "reserve")`:               func() instance { in := compensating(0, 0, 1); in.defVersion = 1; return in }(),
		`stuck: resolve it first`:                     func() instance { in := at(1, `{}`); in.state = StateStuck; return in }(),
		"started on version 1 with step graph 012345": func() instance { in := at(1, `{}`); in.fingerprint.String = "0123456789abcdef"; return in }(),
	}
	for want, in := range stays {
		p := o.planOne(m, in)
		require.False(t, p.plan.Moves(), want)
		require.Contains(t, p.plan.Stays, want)
		require.Zero(t, p.plan.ToVersion)
	}

	// A step with a compensation inserted before the position: it never
	// ran, and a later failure would undo it.
	v2c := vdef(t, 2, vstep("reserve", true), vstep("fraud_check", true), vstep("charge", true), vstep("ship", false))
	vs, err = newVersionSet(v2c, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v1, v2c, keep)}})
	require.NoError(t, err)
	o = &Orchestrator[order]{def: v2c, vs: vs}
	p = o.planOne(vs.migs[0], at(1, `{}`))
	require.Contains(t, p.plan.Stays, `step "fraud_check" comes before "charge" in version 2 and has a compensation, but never ran`)
	// A step that ran, with a compensation, gone from before the position.
	v2r := vdef(t, 2, vstep("charge", true), vstep("ship", false))
	vs, err = newVersionSet(v2r, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v1, v2r, keep)}})
	require.NoError(t, err)
	o = &Orchestrator[order]{def: v2r, vs: vs}
	p = o.planOne(vs.migs[0], at(1, `{}`))
	require.True(t, strings.Contains(p.plan.Stays, `step "reserve" ran and has a compensation, but version 2 has no step "reserve" before "charge"`), p.plan.Stays)
}

func TestVersionsReplyToAStepOnlyAnOlderVersionHasIsMatchedInThatVersion(t *testing.T) {
	t.Parallel()
	v1 := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", false))
	v2 := vdef(t, 2, vstep("reserve", true), vstep("charge", true)) // ship removed
	cfg := Config{}
	cfg.setDefaults("order")
	vs, err := newVersionSet(v2, Config{Versions: []Versioned{v1}})
	require.NoError(t, err)
	o := &Orchestrator[order]{def: v2, d: decider[order]{def: v2, cfg: cfg}, vs: vs, cfg: cfg}
	msg := message.NewMessage("r-1", []byte(`{}`))
	for k, v := range map[string]string{metadata.SagaID: "o-1", metadata.SagaStep: "ship", metadata.SagaPhase: PhaseForward,
		metadata.SagaAttempt: "1", metadata.SagaReplyType: "ship.succeeded"} {
		msg.Metadata.Set(k, v)
	}
	_, err = o.d.parseReply(msg)
	require.ErrorContains(t, err, `unknown step "ship"`, "version 2 alone does not know it")
	r, err := o.parseReply(msg)
	require.NoError(t, err, "version 1 does")

	in := running(2, `{"id":"o-1"}`)
	in.defVersion = 1
	d, r, err := o.versionFor(in, r)
	require.NoError(t, err)
	require.Equal(t, 2, r.stepIdx)
	tr, err := d.decide(in, input{reply: r}, history{}, t0)
	require.NoError(t, err)
	require.Equal(t, StateCompleted, tr.in.state, "version 1's last step succeeded")

	// The same reply to an instance of version 2 is refused: not its step.
	in.defVersion, in.step = 2, 1
	_, _, err = o.versionFor(in, r)
	require.ErrorContains(t, err, `reply names step "ship", which version 2 of the saga does not have (its steps: reserve, charge)`)
}

// A migration into a version where steps that ran one after the other are a
// parallel group: an instance past the group lands with the group's
// branches recorded as succeeded, so that a later failure compensates
// them (an instance without them would skip them, leaving their effects);
// an instance at a step that is a branch in the new version stays.
func TestMigrationIntoAVersionWithAGroup(t *testing.T) {
	t.Parallel()
	v1 := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", true))
	v2 := vdef(t, 2, Step[order]{Name: "prepare", Parallel: []Step[order]{vstep("reserve", true), vstep("charge", true)}}, vstep("ship", true))
	vs, err := newVersionSet(v2, Config{Versions: []Versioned{v1}, Migrations: []Migration{Migrate(v1, v2, keep)}})
	require.NoError(t, err)
	o := &Orchestrator[order]{def: v2, vs: vs}
	at := func(step int) instance {
		in := running(step, `{"id":"o-1"}`)
		in.defVersion, in.fingerprint = 1, sql.NullString{String: v1.Fingerprint(), Valid: true}
		return in
	}

	p := o.planOne(vs.migs[0], at(1))
	require.Contains(t, p.plan.Stays, `version 2 has step "charge" in parallel group "prepare"`)

	p = o.planOne(vs.migs[0], at(2))
	require.True(t, p.plan.Moves(), p.plan.Stays)
	require.Equal(t, "ship", p.plan.ToStep)
	moved := fromRow(p.row)
	require.Equal(t, map[string]BranchInfo{"reserve": {State: BranchSucceeded}, "charge": {State: BranchSucceeded}}, moved.branches)

	// Ship fails on version 2: both branches are compensated, last
	// declared first.
	d, err := vs.decider(moved)
	require.NoError(t, err)
	r := replyInfo{sagaID: "o-1", step: "ship", phase: PhaseForward, attempt: 1, stepIdx: 2, reply: Reply{Type: "ship.failed"}}
	tr, err := d.decide(moved, input{reply: r}, history{loaded: true}, t0)
	require.NoError(t, err)
	require.Len(t, tr.events, 1)
	require.Equal(t, "charge", tr.events[0].Metadata[metadata.SagaStep])
	require.Equal(t, PhaseCompensation, tr.events[0].Metadata[metadata.SagaPhase])
	require.Equal(t, StateCompensating, tr.in.state)
}

// The fingerprint covers groups, waits, timers and Retriable steps: making
// steps a group, or a step a wait, under one version is a change, named.
func TestVersionsGraphCoversGroupsAndWaits(t *testing.T) {
	t.Parallel()
	linear := vdef(t, 1, vstep("reserve", true), vstep("charge", true), vstep("ship", true))
	grouped := vdef(t, 1, Step[order]{Name: "prepare", Parallel: []Step[order]{vstep("reserve", true), vstep("charge", true)}}, vstep("ship", true))
	require.NotEqual(t, linear.Fingerprint(), grouped.Fingerprint())
	require.Contains(t, strings.Join(graphChanges(linear.graphText(), grouped.graphText()), "; "), `"reserve"`)

	wait := vdef(t, 1, vstep("reserve", true), Step[order]{Name: "approve", WaitFor: "approved"})
	timer := vdef(t, 1, vstep("reserve", true), Step[order]{Name: "approve", Sleep: time.Hour})
	require.NotEqual(t, wait.Fingerprint(), timer.Fingerprint())
	require.Contains(t, strings.Join(graphChanges(wait.graphText(), timer.graphText()), "; "), `"approve"`)

	plain := vdef(t, 1, vstep("reserve", true), Step[order]{Name: "notify", Command: vstep("notify", false).Command, NoCompensation: true})
	retried := vdef(t, 1, vstep("reserve", true), Step[order]{Name: "notify", Command: vstep("notify", false).Command, Retriable: true})
	require.NotEqual(t, plain.Fingerprint(), retried.Fingerprint())
	// Timeouts stay out of it.
	slow := vdef(t, 1, vstep("reserve", true), Step[order]{Name: "approve", WaitFor: "approved", Timeout: 48 * time.Hour})
	require.Equal(t, wait.Fingerprint(), slow.Fingerprint())
}
