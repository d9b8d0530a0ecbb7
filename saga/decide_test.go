package saga

import (
	"database/sql"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// The decisions are pure: these tests need no database (run them with
// MILLWRIGHT_TEST_DATABASE_URL unset: go test -run TestDecide ./saga/).

type order struct {
	ID        string `json:"id"`
	Amount    int    `json:"amount"`
	PaymentID string `json:"payment_id,omitempty"`
}

var t0 = time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)

// decideDef is reserve (compensated by release), charge (refund; fails to
// build its command for a negative amount), ship (no compensation).
func decideDef(t *testing.T) decider[order] {
	t.Helper()
	pol := retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute, MaxAttempts: 3, Jitter: retry.JitterNone}
	cmd := func(topic, typ string) func(order) (Command, error) {
		return func(o order) (Command, error) { return Command{Topic: topic, Type: typ, Payload: o}, nil }
	}
	def, err := Define("orders",
		Step[order]{Name: "reserve", Command: cmd("inventory", "reserve.v1"), Compensation: cmd("inventory", "release.v1"),
			Timeout: 10 * time.Second, CompensationTimeout: 5 * time.Second, Retry: pol},
		Step[order]{Name: "charge",
			Command: func(o order) (Command, error) {
				if o.Amount < 0 {
					return Command{}, errors.New("negative amount")
				}
				return Command{Topic: "payment", Type: "charge.v1", Payload: o}, nil
			},
			OnSuccess: func(o *order, r Reply) error {
				var body struct{ ID string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.PaymentID = body.ID
				return nil
			},
			Compensation: func(o order) (Command, error) {
				return Command{Topic: "payment", Type: "refund.v1", Payload: map[string]string{"payment": o.PaymentID}}, nil
			},
			Timeout: 10 * time.Second, CompensationTimeout: 5 * time.Second, Retry: pol},
		Step[order]{Name: "ship", Command: cmd("shipping", "ship.v1"), NoCompensation: true, Timeout: 10 * time.Second},
	)
	require.NoError(t, err)
	cfg := Config{}
	cfg.setDefaults(def.name)
	return decider[order]{def: def, cfg: cfg}
}

// running is saga o-1 waiting for step's reply.
func running(step int, data string) instance {
	return instance{id: "o-1", typ: "orders", state: StateRunning, step: step, data: []byte(data), version: 3,
		awaiting: true, deadline: sql.NullTime{Time: t0.Add(10 * time.Second), Valid: true}, createdAt: t0.Add(-time.Minute)}
}

// compensating is saga o-1 waiting for attempt (base+attempts) of step's
// compensation.
func compensating(step, base, attempts int) instance {
	in := running(step, `{"id":"o-1","amount":42,"payment_id":"p-7"}`)
	in.state, in.attemptBase, in.compAttempts = StateCompensating, base, attempts
	in.compStarted = sql.NullTime{Time: t0.Add(-time.Second), Valid: true}
	in.cause = sql.NullString{String: "step \"ship\" failed: no truck", Valid: true}
	in.lastError = in.cause
	return in
}

func reply(d decider[order], step, phase string, attempt int, typ string, payload string) replyInfo {
	return replyInfo{sagaID: "o-1", step: step, phase: phase, attempt: attempt, stepIdx: d.def.index[step],
		reply: Reply{Type: typ, Payload: []byte(payload), Metadata: map[string]string{}}}
}

var loaded = history{loaded: true}

// decide decides and requires a transition.
func decide(t *testing.T, d decider[order], in instance, inp input, h history) *transition {
	t.Helper()
	tr, err := d.decide(in, inp, h, t0)
	require.NoError(t, err)
	return tr
}

func kinds(tr *transition) []string {
	var out []string
	for _, h := range tr.hist {
		out = append(out, h.step+":"+h.kind+":"+strconv.Itoa(h.attempt))
	}
	return out
}

// commands are the transition's commands as "step/phase/attempt type".
func commands(tr *transition) []string {
	var out []string
	for _, e := range tr.events {
		out = append(out, e.Metadata[metadata.SagaStep]+"/"+e.Metadata[metadata.SagaPhase]+"/"+e.Metadata[metadata.SagaAttempt]+" "+e.EventType)
	}
	return out
}

func TestDecideStart(t *testing.T) {
	d := decideDef(t)
	tr, err := d.decideStart("o-1", order{ID: "o-1", Amount: 42}, t0)
	require.NoError(t, err)
	require.Equal(t, StateRunning, tr.in.state)
	require.Zero(t, tr.in.step)
	require.True(t, tr.in.awaiting)
	require.Equal(t, t0.Add(10*time.Second), tr.in.deadline.Time)
	require.Equal(t, []string{"reserve:command:1"}, kinds(tr))
	require.Equal(t, []string{"reserve/forward/1 reserve.v1"}, commands(tr))
	require.Equal(t, "orders_replies", tr.events[0].Metadata[metadata.SagaReplyTo])
	require.JSONEq(t, `{"id":"o-1","amount":42}`, string(tr.in.data))
}

func TestDecideSuccessSendsTheNextCommandWithoutHistory(t *testing.T) {
	d := decideDef(t)
	in := running(1, `{"id":"o-1","amount":42}`)
	tr := decide(t, d, in, input{reply: reply(d, "charge", PhaseForward, 1, "charge.succeeded", `{"ID":"p-7"}`)}, history{})
	require.Equal(t, []string{"charge:reply:1", "ship:command:1"}, kinds(tr))
	require.Equal(t, []string{"ship/forward/1 ship.v1"}, commands(tr))
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, 2, tr.in.step)
	require.EqualValues(t, 3, tr.in.version, "written over the version read")
	require.JSONEq(t, `{"id":"o-1","amount":42,"payment_id":"p-7"}`, string(tr.in.data), "OnSuccess updated the data")
	require.Equal(t, t0.Add(10*time.Second), tr.in.deadline.Time)
	require.Empty(t, tr.notes)
}

func TestDecideLastSuccessCompletes(t *testing.T) {
	d := decideDef(t)
	tr := decide(t, d, running(2, `{}`), input{reply: reply(d, "ship", PhaseForward, 1, "ship.succeeded", `{}`)}, history{})
	require.Equal(t, StateCompleted, tr.in.state)
	require.False(t, tr.in.deadline.Valid)
	require.Empty(t, tr.events)
	require.Equal(t, []string{"ship:reply:1", "ship:completed:0"}, kinds(tr))
	require.True(t, tr.has(noteCompleted))
}

// A failure compensates the earlier steps in reverse order, skipping the
// ones without compensation, then the saga is compensated.
func TestDecideFailureCompensatesInReverseOrder(t *testing.T) {
	d := decideDef(t)
	in := running(2, `{"id":"o-1","amount":42,"payment_id":"p-7"}`)
	failure := reply(d, "ship", PhaseForward, 1, "ship.failed", "")
	failure.reply.Metadata[metadata.SagaError] = "no truck"
	_, err := d.decide(in, input{reply: failure}, history{}, t0)
	require.ErrorIs(t, err, errNeedHistory, "starting a compensation reads the attempts so far")

	tr := decide(t, d, in, input{reply: failure}, loaded)
	require.Equal(t, []string{"ship:reply:1", "charge:compensation:1"}, kinds(tr))
	require.Equal(t, "no truck", tr.hist[0].err)
	require.Equal(t, []string{"charge/compensation/1 refund.v1"}, commands(tr))
	require.JSONEq(t, `{"payment":"p-7"}`, string(tr.events[0].Payload))
	require.Equal(t, StateCompensating, tr.in.state)
	require.Equal(t, 1, tr.in.step)
	require.Equal(t, `step "ship" failed: no truck`, tr.in.cause.String)
	require.Equal(t, t0.Add(5*time.Second), tr.in.deadline.Time)
	require.Equal(t, t0, tr.in.compStarted.Time)

	tr = decide(t, d, tr.in, input{reply: reply(d, "charge", PhaseCompensation, 1, "charge.compensated", "")}, loaded)
	require.Equal(t, []string{"charge:compensation_reply:1", "reserve:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"reserve/compensation/1 release.v1"}, commands(tr))
	require.Zero(t, tr.in.step)

	tr = decide(t, d, tr.in, input{reply: reply(d, "reserve", PhaseCompensation, 1, "reserve.compensated", "")}, loaded)
	require.Equal(t, []string{"reserve:compensation_reply:1", ":compensated:0"}, kinds(tr))
	require.Equal(t, StateCompensated, tr.in.state)
	require.Equal(t, -1, tr.in.step)
	require.False(t, tr.in.deadline.Valid)
	require.Equal(t, `step "ship" failed: no truck`, tr.in.lastError.String)
	require.True(t, tr.has(noteCompensated))

	// A saga compensated before (reopened by a late success) is counted once.
	again := decide(t, d, compensating(0, 0, 1), input{reply: reply(d, "reserve", PhaseCompensation, 1, "reserve.compensated", "")},
		history{loaded: true, compensated: true})
	require.Equal(t, StateCompensated, again.in.state)
	require.False(t, again.has(noteCompensated))
}

// The first step's failure has nothing to compensate.
func TestDecideFirstStepFailureIsCompensatedAtOnce(t *testing.T) {
	d := decideDef(t)
	tr := decide(t, d, running(0, `{}`), input{reply: reply(d, "reserve", PhaseForward, 1, "reserve.failed", "out of stock")}, loaded)
	require.Equal(t, []string{"reserve:reply:1", ":compensated:0"}, kinds(tr))
	require.Equal(t, "out of stock", tr.hist[0].err, "the payload is the reason without SagaError")
	require.Equal(t, StateCompensated, tr.in.state)
}

// A compensation that fails waits its backoff, is resent, and past its
// budget the saga is stuck.
func TestDecideCompensationFailuresRetryThenStick(t *testing.T) {
	d := decideDef(t)
	in := compensating(1, 0, 1)
	tr := decide(t, d, in, input{reply: reply(d, "charge", PhaseCompensation, 1, "charge.compensation_failed", "gateway down")}, history{})
	require.Equal(t, []string{"charge:compensation_reply:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.Equal(t, StateCompensating, tr.in.state)
	require.False(t, tr.in.awaiting, "the deadline is a backoff, not a reply timeout")
	require.Equal(t, t0.Add(time.Second), tr.in.deadline.Time)
	require.Equal(t, `step "ship" failed: no truck; then compensation of step "charge" failed (attempt 1): gateway down`, tr.in.lastError.String)

	// The backoff passes: attempt 2 is sent (no history needed).
	tr = decide(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge:compensation:2"}, kinds(tr))
	require.Equal(t, []string{"charge/compensation/2 refund.v1"}, commands(tr))
	require.True(t, tr.in.awaiting)
	require.Equal(t, 2, tr.in.compAttempts)

	// Attempt 2 times out: backoff 2s.
	tr = decide(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge:timeout:2"}, kinds(tr))
	require.Equal(t, t0.Add(2*time.Second), tr.in.deadline.Time)

	// Attempt 3 fails: MaxAttempts 3 spent, stuck.
	tr = decide(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge/compensation/3 refund.v1"}, commands(tr))
	tr = decide(t, d, tr.in, input{reply: reply(d, "charge", PhaseCompensation, 3, "charge.compensation_failed", "")}, history{})
	require.Equal(t, []string{"charge:compensation_reply:3", "charge:stuck:3"}, kinds(tr))
	require.Equal(t, StateStuck, tr.in.state)
	require.False(t, tr.in.deadline.Valid)
	require.True(t, tr.has(noteStuck))
}

// A step that times out is failed and compensated, its own compensation
// included (its effect may have happened).
func TestDecideStepTimeout(t *testing.T) {
	d := decideDef(t)
	tr := decide(t, d, running(1, `{"id":"o-1"}`), input{deadline: true}, loaded)
	require.Equal(t, []string{"charge:timeout:1", "charge:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"charge/compensation/1 refund.v1"}, commands(tr))
	require.Equal(t, `step "charge" timed out after 10s`, tr.in.cause.String)
	require.Equal(t, 1, tr.in.step)
	require.True(t, tr.has(noteTimeout))

	// A step without compensation that times out goes to the one before.
	tr = decide(t, d, running(2, `{}`), input{deadline: true}, loaded)
	require.Equal(t, []string{"ship:timeout:1", "charge:compensation:1"}, kinds(tr))
}

// A success that arrives after its step timed out sends the step's
// compensation again, numbered after every earlier attempt, and the chain
// it interrupted resumes afterwards.
func TestDecideLateSuccess(t *testing.T) {
	d := decideDef(t)
	late := reply(d, "charge", PhaseForward, 1, "charge.succeeded", `{"ID":"p-late"}`)
	// charge timed out; its compensation (attempt 1) was answered; reserve's
	// is current.
	in := compensating(0, 0, 1)
	_, err := d.decide(in, input{reply: late}, history{}, t0)
	require.ErrorIs(t, err, errNeedHistory, "a stale reply reads whether it was answered")

	h := history{loaded: true, compAttempts: map[string]int{"charge": 1, "reserve": 1}}
	tr := decide(t, d, in, input{reply: late}, h)
	require.Equal(t, []string{"charge:late_success:1", "charge:compensation:2"}, kinds(tr))
	require.Equal(t, []string{"charge/compensation/2 refund.v1"}, commands(tr))
	require.JSONEq(t, `{"payment":"p-late"}`, string(tr.events[0].Payload), "the compensation sees what the success said")
	require.Equal(t, 1, tr.in.attemptBase)
	require.Equal(t, 1, tr.in.compAttempts)
	require.Equal(t, sql.NullInt64{Int64: 0, Valid: true}, tr.in.resumeStep, "reserve's compensation goes on afterwards")
	require.True(t, tr.has(noteLateSuccess))
	require.Contains(t, tr.in.lastError.String, `step "charge" succeeded after it timed out: undoing it`)

	// The reply to attempt 1 of charge's compensation is not this round's.
	stale := decide(t, d, tr.in, input{reply: reply(d, "charge", PhaseCompensation, 1, "charge.compensated", "")}, history{loaded: true, answered: true})
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(stale))
	require.Zero(t, stale.in.version, "history only")

	// Attempt 2 answered: back to reserve's compensation, renumbered.
	tr = decide(t, d, tr.in, input{reply: reply(d, "charge", PhaseCompensation, 2, "charge.compensated", "")}, h)
	require.Equal(t, []string{"charge:compensation_reply:2", "reserve:compensation:2"}, kinds(tr))
	require.False(t, tr.in.resumeStep.Valid)
	require.Equal(t, 0, tr.in.step)

	// The same success again: answered (the late success), a duplicate.
	dup := decide(t, d, compensating(0, 0, 1), input{reply: late}, history{loaded: true, answered: true})
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(dup))
	require.Empty(t, dup.events)
	require.True(t, dup.has(noteIgnored))
}

// A late success reopens a compensated saga; a late success of a step
// without compensation, and a late failure, are ignored.
func TestDecideLateSuccessReopensACompensatedSaga(t *testing.T) {
	d := decideDef(t)
	in := compensating(-1, 0, 0)
	in.state, in.awaiting, in.deadline = StateCompensated, false, sql.NullTime{}
	tr := decide(t, d, in, input{reply: reply(d, "reserve", PhaseForward, 1, "reserve.succeeded", `{}`)},
		history{loaded: true, compensated: true, compAttempts: map[string]int{"reserve": 2}})
	require.Equal(t, StateCompensating, tr.in.state)
	require.Equal(t, []string{"reserve/compensation/3 release.v1"}, commands(tr))
	require.Equal(t, sql.NullInt64{Int64: -1, Valid: true}, tr.in.resumeStep)
	done := decide(t, d, tr.in, input{reply: reply(d, "reserve", PhaseCompensation, 3, "reserve.compensated", "")},
		history{loaded: true, compensated: true})
	require.Equal(t, StateCompensated, done.in.state)
	require.False(t, done.has(noteCompensated), "counted when first compensated")

	ship := decide(t, d, in, input{reply: reply(d, "ship", PhaseForward, 1, "ship.succeeded", `{}`)}, loaded)
	require.Equal(t, []string{"ship:late_reply:1"}, kinds(ship))
	failed := decide(t, d, in, input{reply: reply(d, "charge", PhaseForward, 1, "charge.failed", "")}, loaded)
	require.Equal(t, []string{"charge:late_reply:1"}, kinds(failed))
	require.Empty(t, failed.events)
}

// A reply already acted on is a duplicate; one to a command that is no
// longer current and was never answered is late.
func TestDecideDuplicateAndStaleReplies(t *testing.T) {
	d := decideDef(t)
	in := running(2, `{}`)
	dup := decide(t, d, in, input{reply: reply(d, "charge", PhaseForward, 1, "charge.succeeded", `{}`)}, history{loaded: true, answered: true})
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(dup))
	require.Zero(t, dup.in.version)
	require.Equal(t, "o-1", dup.in.id)
	require.Equal(t, note{what: noteIgnored, step: "charge", kind: KindDuplicate, phase: PhaseForward, reply: "charge.succeeded",
		attempt: 1, state: StateRunning}, dup.notes[0])

	// A compensation reply while running is not current.
	late := decide(t, d, in, input{reply: reply(d, "reserve", PhaseCompensation, 1, "reserve.compensated", "")}, loaded)
	require.Equal(t, []string{"reserve:late_reply:1"}, kinds(late))
	// Neither is a reply to an earlier compensation attempt.
	old := decide(t, d, compensating(1, 0, 2), input{reply: reply(d, "charge", PhaseCompensation, 1, "charge.compensation_failed", "")}, loaded)
	require.Equal(t, []string{"charge:late_reply:1"}, kinds(old))
}

// A compensation attempt number starts after the highest the step was ever
// sent with.
func TestDecideAttemptRenumbering(t *testing.T) {
	d := decideDef(t)
	failure := reply(d, "ship", PhaseForward, 1, "ship.failed", "")
	tr := decide(t, d, running(2, `{}`), input{reply: failure}, history{loaded: true, compAttempts: map[string]int{"charge": 4}})
	require.Equal(t, []string{"charge/compensation/5 refund.v1"}, commands(tr))
	require.Equal(t, 4, tr.in.attemptBase)
	require.Equal(t, 5, tr.in.attempt())
	ok := decide(t, d, tr.in, input{reply: reply(d, "charge", PhaseCompensation, 5, "charge.compensated", "")}, loaded)
	require.Equal(t, []string{"charge:compensation_reply:5", "reserve:compensation:1"}, kinds(ok))
}

// An operator's resolution leaves the saga compensating with no attempt:
// the next deadline starts that compensation afresh (retry), or goes on
// below it (skip: the current step moved), or to compensated.
func TestDecideResume(t *testing.T) {
	d := decideDef(t)
	retried := compensating(1, 0, 0)
	retried.awaiting = false
	tr := decide(t, d, retried, input{deadline: true}, history{loaded: true, compAttempts: map[string]int{"charge": 3}})
	require.Equal(t, []string{"charge:compensation:4"}, kinds(tr))
	require.Equal(t, 1, tr.in.compAttempts)
	require.True(t, tr.in.awaiting)

	skipped := compensating(-1, 0, 0)
	skipped.awaiting = false
	tr = decide(t, d, skipped, input{deadline: true}, loaded)
	require.Equal(t, StateCompensated, tr.in.state)
	require.Equal(t, []string{":compensated:0"}, kinds(tr))

	// A stray deadline on a final state is cleared.
	done := running(2, `{}`)
	done.state = StateCompleted
	tr = decide(t, d, done, input{deadline: true}, history{})
	require.False(t, tr.in.deadline.Valid)
	require.Empty(t, tr.hist)
}

// The next step's command that cannot be built fails the saga there, and
// the steps done so far, the one just succeeded included, are compensated.
func TestDecideCommandBuildError(t *testing.T) {
	d := decideDef(t)
	tr := decide(t, d, running(0, `{"id":"o-1","amount":-1}`), input{reply: reply(d, "reserve", PhaseForward, 1, "reserve.succeeded", `{}`)}, loaded)
	require.Equal(t, []string{"reserve:reply:1", "charge:command:1", "reserve:compensation:1"}, kinds(tr))
	require.Contains(t, tr.hist[1].err, "negative amount")
	require.Equal(t, []string{"reserve/compensation/1 release.v1"}, commands(tr))
}

// Data the saga type cannot decode parks the saga at its deadline; a reply
// to it fails (and is redelivered) without writing.
func TestDecideUndecodableData(t *testing.T) {
	d := decideDef(t)
	in := running(1, `{"amount":"many"}`)
	tr := decide(t, d, in, input{deadline: true}, history{})
	require.Equal(t, StateStuck, tr.in.state)
	require.Contains(t, tr.in.lastError.String, "decoding data into saga.order")
	require.True(t, tr.has(noteStuck))
	_, err := d.decide(in, input{reply: reply(d, "charge", PhaseForward, 1, "charge.succeeded", `{}`)}, history{}, t0)
	require.ErrorContains(t, err, "decoding data")
}

// An instance whose position is not a step of the definition (steps were
// removed while it ran) is refused with ErrUnknownPosition, never indexed:
// before, a deadline on it panicked with an index out of range, and so did
// the compensation reply of one whose resume step was gone. setAside then
// makes it stuck with the reason.
func TestDecideRefusesAPositionOutsideTheDefinition(t *testing.T) {
	d := decideDef(t)
	compensating := func(step int) instance {
		in := running(step, `{"id":"o-1"}`)
		in.state = StateCompensating
		return in
	}
	resuming := compensating(0)
	resuming.resumeStep = sql.NullInt64{Int64: 9, Valid: true}
	resuming.compAttempts, resuming.awaiting = 1, true
	backoff := compensating(4)
	backoff.compAttempts = 1
	cases := map[string]struct {
		in  instance
		inp input
	}{
		"running past the last step, deadline":      {running(3, `{}`), input{deadline: true}},
		"compensating past the last step, deadline": {compensating(7), input{deadline: true}},
		"compensation backoff past the last step":   {backoff, input{deadline: true}},
		"below -1": {running(-2, `{}`), input{deadline: true}},
		"resume step gone, compensated reply": {resuming, input{reply: replyInfo{sagaID: "o-1", step: "reserve", phase: PhaseCompensation,
			attempt: 1, stepIdx: 0, reply: Reply{Type: "reserve.compensated"}}}},
	}
	for name, c := range cases {
		for _, h := range []history{{}, loaded} {
			_, err := d.decide(c.in, c.inp, h, t0)
			require.ErrorIs(t, err, ErrUnknownPosition, name)
			require.Contains(t, err.Error(), "the definition has 3 step(s)", name)
		}
		tr := d.setAside(c.in, "gone")
		require.Equal(t, StateStuck, tr.in.state, name)
		require.False(t, tr.in.deadline.Valid, name)
		require.Equal(t, "set aside: gone", tr.in.lastError.String, name)
		require.True(t, tr.has(noteSetAside), name)
	}
}
