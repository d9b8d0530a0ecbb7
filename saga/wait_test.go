package saga

import (
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/retry"
)

// The decisions of waiting, timer and Retriable steps (wait.go), pure:
// run them with no database (go test -run TestDecideWait ./saga/).

// waitDef is reserve (compensated by release), approval (waits for
// approval.granted; OnSuccess copies the approved amount), cool (sleeps
// 5m), charge and ship (Retriable, 3 attempts, 1s then 2s backoff), and a
// closing timer until the data's "due" time.
func waitDef(t *testing.T) decider[waitData] {
	t.Helper()
	pol := retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute, MaxAttempts: 3, Jitter: retry.JitterNone}
	cmd := func(topic, typ string) func(waitData) (Command, error) {
		return func(o waitData) (Command, error) {
			if o.Amount < 0 {
				return Command{}, errors.New("negative amount")
			}
			return Command{Topic: topic, Type: typ, Payload: o}, nil
		}
	}
	def, err := Define("orders",
		Step[waitData]{Name: "reserve", Command: cmd("inventory", "reserve.v1"), Compensation: cmd("inventory", "release.v1"),
			Timeout: 10 * time.Second, CompensationTimeout: 5 * time.Second, Retry: pol},
		Step[waitData]{Name: "approval", WaitFor: "approval.granted", Timeout: time.Hour,
			OnSuccess: func(o *waitData, r Reply) error {
				var body struct{ Amount int }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.Amount = body.Amount
				return nil
			}},
		Step[waitData]{Name: "cool", Sleep: 5 * time.Minute},
		Step[waitData]{Name: "charge", Command: cmd("payment", "charge.v1"), Retriable: true, Timeout: 10 * time.Second, Retry: pol},
		Step[waitData]{Name: "ship", Command: cmd("shipping", "ship.v1"), Retriable: true, Timeout: 10 * time.Second, Retry: pol},
		Step[waitData]{Name: "settle", Until: func(o waitData) time.Time { return o.Due }},
	)
	require.NoError(t, err)
	cfg := Config{}
	cfg.setDefaults(def.name)
	return decider[waitData]{def: def, cfg: cfg}
}

type waitData struct {
	ID     string    `json:"id"`
	Amount int       `json:"amount"`
	Due    time.Time `json:"due"`
}

func runningAt(d decider[waitData], step string, data string) instance {
	in := running(d.def.index[step], data)
	in.deadline = sql.NullTime{Time: t0, Valid: true}
	return in
}

func decideW(t *testing.T, d decider[waitData], in instance, inp input, h history) *transition {
	t.Helper()
	tr, err := d.decide(in, inp, h, t0)
	require.NoError(t, err)
	return tr
}

func replyW(d decider[waitData], step, phase string, attempt int, typ, payload string) replyInfo {
	return replyInfo{sagaID: "o-1", step: step, phase: phase, attempt: attempt, stepIdx: d.def.index[step],
		reply: Reply{Type: typ, Payload: []byte(payload), Metadata: map[string]string{}}}
}

// A waiting step sends nothing: the saga waits, with the step's timeout as
// its deadline; the event continues it with its payload in the data.
func TestDecideWaitEventContinues(t *testing.T) {
	d := waitDef(t)
	tr := decideW(t, d, running(0, `{"id":"o-1","amount":42}`), input{reply: replyW(d, "reserve", PhaseForward, 1, "reserve.succeeded", `{}`)}, history{})
	require.Equal(t, []string{"reserve:reply:1", "approval:wait:1"}, kinds(tr))
	require.Empty(t, tr.events, "a waiting step sends no command")
	require.Equal(t, StateRunning, tr.in.state)
	require.Equal(t, 1, tr.in.step)
	require.True(t, tr.in.awaiting)
	require.Equal(t, t0.Add(time.Hour), tr.in.deadline.Time)
	require.Equal(t, "approval.granted", tr.hist[1].detail)

	r, err := d.signalReply("o-1", "approval.granted", map[string]int{"Amount": 40})
	require.NoError(t, err)
	require.NoError(t, d.waiting(tr.in, r))
	tr = decideW(t, d, tr.in, input{reply: r}, history{})
	require.Equal(t, []string{"approval:reply:1", "cool:timer:1"}, kinds(tr))
	require.JSONEq(t, `{"id":"o-1","amount":40,"due":"0001-01-01T00:00:00Z"}`, string(tr.in.data), "OnSuccess read the event")
	require.Empty(t, tr.events)
	require.Equal(t, 2, tr.in.step)
	require.Equal(t, t0.Add(5*time.Minute), tr.in.deadline.Time, "the timer's deadline")
}

// The wait's timeout compensates the steps before it; the wait itself has
// nothing to undo. A rejection does the same.
func TestDecideWaitTimeoutAndRejectionCompensate(t *testing.T) {
	d := waitDef(t)
	in := runningAt(d, "approval", `{"id":"o-1"}`)
	tr := decideW(t, d, in, input{deadline: true}, loaded)
	require.Equal(t, []string{"approval:timeout:1", "reserve:compensation:1"}, kinds(tr))
	require.Equal(t, []string{"reserve/compensation/1 release.v1"}, commands(tr))
	require.Equal(t, StateCompensating, tr.in.state)
	require.Equal(t, `step "approval" timed out after 1h0m0s`, tr.in.cause.String)

	r, err := d.signalReply("o-1", "approval.failed", "rejected by finance")
	require.NoError(t, err)
	require.Equal(t, "approval", r.step, "the step's FailureReply names it too")
	tr = decideW(t, d, in, input{reply: r}, loaded)
	require.Equal(t, []string{"approval:reply:1", "reserve:compensation:1"}, kinds(tr))
	require.Contains(t, tr.in.cause.String, `step "approval" failed`)
}

// An event after the wait timed out is recorded and ignored; Signal says
// the saga no longer waits.
func TestDecideWaitLateEventIsIgnored(t *testing.T) {
	d := waitDef(t)
	in := compensating(0, 0, 1) // approval timed out, reserve's release is out
	r, err := d.signalReply("o-1", "approval.granted", nil)
	require.NoError(t, err)
	_, err = d.decide(in, input{reply: r}, history{}, t0)
	require.ErrorIs(t, err, errNeedHistory)
	tr := decideW(t, d, in, input{reply: r}, loaded)
	require.Equal(t, []string{"approval:late_reply:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.Zero(t, tr.in.version, "only history is written")
	require.True(t, tr.has(noteIgnored))

	err = d.waiting(in, r)
	require.ErrorIs(t, err, ErrNotWaiting)
	require.ErrorContains(t, err, `event "approval.granted" is for step "approval", but the saga is compensating`)

	// Before the saga reaches the step.
	err = d.waiting(runningAt(d, "reserve", `{}`), r)
	require.ErrorIs(t, err, ErrNotWaiting)
	require.ErrorContains(t, err, `at step "reserve", before step "approval"`)

	_, err = d.signalReply("o-1", "approval.maybe", nil)
	require.ErrorContains(t, err, `event "approval.maybe" for "o-1": no step waits for it; the saga waits for "approval.granted" (step "approval"; "approval.failed" rejects it)`)
}

// A timer's deadline is its success; Until reads the data.
func TestDecideTimerFires(t *testing.T) {
	d := waitDef(t)
	tr := decideW(t, d, runningAt(d, "cool", `{"id":"o-1","amount":42}`), input{deadline: true}, history{})
	require.Equal(t, []string{"cool:timer_fired:1", "charge:command:1"}, kinds(tr))
	require.Equal(t, []string{"charge/forward/1 charge.v1"}, commands(tr))
	require.True(t, tr.in.forwardRetry)
	require.Equal(t, 1, tr.in.compAttempts)

	due := t0.Add(48 * time.Hour)
	in := runningAt(d, "ship", `{"id":"o-1","due":"`+due.Format(time.RFC3339)+`"}`)
	in.forwardRetry, in.compAttempts = true, 1
	tr = decideW(t, d, in, input{reply: replyW(d, "ship", PhaseForward, 1, "ship.succeeded", `{}`)}, history{})
	require.Equal(t, []string{"ship:reply:1", "settle:timer:1"}, kinds(tr))
	require.Equal(t, due, tr.in.deadline.Time.UTC())
	require.False(t, tr.in.forwardRetry)
	require.Zero(t, tr.in.compAttempts, "the round is cleared")

	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"settle:timer_fired:1", "settle:completed:0"}, kinds(tr))
	require.Equal(t, StateCompleted, tr.in.state)
	require.True(t, tr.has(noteCompleted))
}

// A Retriable step's failure and timeout resend its command after the
// backoff, never compensating; past Retry it is stuck; a success of any
// attempt continues, a failure of an earlier one is ignored.
func TestDecideRetriableRetriesThenSticks(t *testing.T) {
	d := waitDef(t)
	in := runningAt(d, "charge", `{"id":"o-1","amount":42}`)
	in.forwardRetry, in.compAttempts, in.compStarted = true, 1, sql.NullTime{Time: t0, Valid: true}

	fail := replyW(d, "charge", PhaseForward, 1, "charge.failed", "card declined")
	tr := decideW(t, d, in, input{reply: fail}, history{})
	require.Equal(t, []string{"charge:reply:1"}, kinds(tr))
	require.Empty(t, tr.events, "no compensation")
	require.Equal(t, StateRunning, tr.in.state)
	require.False(t, tr.in.awaiting)
	require.Equal(t, t0.Add(time.Second), tr.in.deadline.Time)
	require.Equal(t, `step "charge" failed (attempt 1): card declined`, tr.in.lastError.String)

	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge:command:2"}, kinds(tr))
	require.Equal(t, []string{"charge/forward/2 charge.v1"}, commands(tr))
	require.True(t, tr.in.awaiting)
	require.Equal(t, t0.Add(10*time.Second), tr.in.deadline.Time)

	// attempt 1's failure again (a redelivery, late): ignored.
	stale := decideW(t, d, tr.in, input{reply: fail}, history{loaded: true, answered: true})
	require.Equal(t, []string{"charge:duplicate:1"}, kinds(stale))
	require.Zero(t, stale.in.version)

	// attempt 2 times out: backoff 2s, then attempt 3.
	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge:timeout:2"}, kinds(tr))
	require.Equal(t, t0.Add(2*time.Second), tr.in.deadline.Time)
	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge/forward/3 charge.v1"}, commands(tr))

	// attempt 3 fails: MaxAttempts 3 spent, stuck (still forward).
	tr = decideW(t, d, tr.in, input{reply: replyW(d, "charge", PhaseForward, 3, "charge.failed", "")}, history{})
	require.Equal(t, []string{"charge:reply:3", "charge:stuck:3"}, kinds(tr))
	require.Equal(t, StateStuck, tr.in.state)
	require.True(t, tr.in.forwardRetry)
	require.False(t, tr.in.deadline.Valid)
	require.True(t, tr.has(noteStuck))
	require.Equal(t, PhaseForward, tr.notes[0].phase)

	// Attempt 2's success arrives after all: the step succeeded.
	tr = decideW(t, d, tr.in, input{reply: replyW(d, "charge", PhaseForward, 2, "charge.succeeded", `{}`)}, history{})
	require.Equal(t, []string{"charge:reply:2", "ship:command:1"}, kinds(tr))
	require.Equal(t, StateRunning, tr.in.state)
	require.False(t, tr.in.lastError.Valid)
	require.Equal(t, 1, tr.in.compAttempts, "ship's own round")
	require.Zero(t, tr.in.attemptBase)
}

// A success while the step waits out its backoff continues at once.
func TestDecideRetriableSuccessDuringBackoff(t *testing.T) {
	d := waitDef(t)
	in := runningAt(d, "charge", `{"id":"o-1"}`)
	in.forwardRetry, in.compAttempts, in.awaiting = true, 1, false
	tr := decideW(t, d, in, input{reply: replyW(d, "charge", PhaseForward, 1, "charge.succeeded", `{}`)}, history{})
	require.Equal(t, []string{"charge:reply:1", "ship:command:1"}, kinds(tr))
}

// A saga whose first step is Retriable was inserted without its round:
// its first failure is attempt 1, timed from the start.
func TestDecideRetriableFirstStep(t *testing.T) {
	pol := retry.Policy{InitialInterval: time.Second, MaxAttempts: 2, Jitter: retry.JitterNone}
	def := MustDefine("r", Step[waitData]{Name: "a", Retriable: true, Retry: pol,
		Command: func(o waitData) (Command, error) {
			if o.Amount < 0 {
				return Command{}, errors.New("negative amount")
			}
			return Command{Topic: "a"}, nil
		}})
	d := decider[waitData]{def: def, cfg: Config{ReplyTopic: "r_replies", ReplyShards: 1}}
	_, err := d.decideStart("o-1", waitData{Amount: -1}, t0)
	require.ErrorContains(t, err, `step "a": building command: negative amount`, "Start still refuses")

	tr, err := d.decideStart("o-1", waitData{}, t0)
	require.NoError(t, err)
	require.Equal(t, []string{"a/forward/1 "}, commands(tr))
	in := tr.in
	in.version, in.compAttempts, in.compStarted, in.forwardRetry = 1, 0, sql.NullTime{}, false // as inserted
	tr = decideW(t, d, in, input{reply: replyInfo{sagaID: "o-1", step: "a", phase: PhaseForward, attempt: 1,
		reply: Reply{Type: "a.failed"}}}, history{})
	require.Equal(t, 1, tr.in.compAttempts)
	require.Equal(t, in.createdAt, tr.in.compStarted.Time)
	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, []string{"a/forward/2 "}, commands(tr))
	tr = decideW(t, d, tr.in, input{deadline: true}, history{})
	require.Equal(t, StateStuck, tr.in.state, "2 attempts spent")
}

// A Retriable step's command that cannot be built is a failed attempt.
func TestDecideRetriableCommandErrorIsAFailedAttempt(t *testing.T) {
	d := waitDef(t)
	tr := decideW(t, d, runningAt(d, "cool", `{"id":"o-1","amount":-1}`), input{deadline: true}, history{})
	require.Equal(t, []string{"cool:timer_fired:1", "charge:command:1"}, kinds(tr))
	require.Empty(t, tr.events)
	require.Equal(t, `step "charge": building command: negative amount (attempt 1)`, tr.hist[1].err)
	require.Equal(t, StateRunning, tr.in.state, "not compensated")
	require.False(t, tr.in.awaiting)
	require.Equal(t, t0.Add(time.Second), tr.in.deadline.Time)
}

// What Resolve writes for a saga stuck on a Retriable step (running, not
// awaiting, round cleared): retry sends the command in a new round
// numbered after the earlier ones; skip goes on with the next step.
func TestDecideRetriableResolved(t *testing.T) {
	d := waitDef(t)
	in := runningAt(d, "charge", `{"id":"o-1"}`)
	in.awaiting, in.forwardRetry, in.attemptBase = false, true, 3 // resolved retry after 3 attempts
	tr := decideW(t, d, in, input{deadline: true}, history{})
	require.Equal(t, []string{"charge/forward/4 charge.v1"}, commands(tr))
	require.Equal(t, 1, tr.in.compAttempts, "a fresh budget")

	in.forwardRetry = false // resolved skip
	tr = decideW(t, d, in, input{deadline: true}, history{})
	require.Equal(t, []string{"ship:command:1"}, kinds(tr))
	require.Equal(t, []string{"ship/forward/1 ship.v1"}, commands(tr))
}

func TestDecideTimerTakesNoReply(t *testing.T) {
	d := waitDef(t)
	err := d.timerReplyError(replyW(d, "cool", PhaseForward, 1, "cool.succeeded", ""))
	require.ErrorContains(t, err, `step "cool", a timer step: it takes no replies`)
}

func TestDefineWaitingStepRules(t *testing.T) {
	cmd := func(struct{}) (Command, error) { return Command{Topic: "t"}, nil }
	until := func(struct{}) time.Time { return t0 }
	first := Step[struct{}]{Name: "first", Command: cmd, Compensation: cmd}
	for name, tc := range map[string]struct {
		steps []Step[struct{}]
		want  string
	}{
		"wait with command":     {[]Step[struct{}]{{Name: "w", WaitFor: "e", Command: cmd}}, `step "w": WaitFor and Command are both set`},
		"wait with timer":       {[]Step[struct{}]{{Name: "w", WaitFor: "e", Sleep: time.Second}}, `step "w": WaitFor and Sleep/Until are both set`},
		"wait success reply":    {[]Step[struct{}]{{Name: "w", WaitFor: "e", SuccessReply: "f"}}, `step "w": SuccessReply: "f" differs from WaitFor "e"`},
		"wait compensation":     {[]Step[struct{}]{{Name: "w", WaitFor: "e", Compensation: cmd}}, `step "w": Compensation: a waiting step has nothing to undo`},
		"wait retriable":        {[]Step[struct{}]{{Name: "w", WaitFor: "e", Retriable: true}}, `step "w": Retriable: a waiting step sends no command to retry`},
		"wait retry":            {[]Step[struct{}]{{Name: "w", WaitFor: "e", Retry: retry.Policy{MaxAttempts: 2}}}, `step "w": CompensationTimeout, CompensatedReply, CompensationFailedReply or Retry is set`},
		"same event":            {[]Step[struct{}]{{Name: "w", WaitFor: "e"}, {Name: "v", WaitFor: "e"}}, `step "v": WaitFor "e" is also step "w"'s`},
		"sleep and until":       {[]Step[struct{}]{{Name: "s", Sleep: time.Second, Until: until}}, `step "s": Sleep and Until are both set`},
		"sleep with command":    {[]Step[struct{}]{{Name: "s", Sleep: time.Second, Command: cmd}}, `step "s": Sleep/Until and Command are both set`},
		"negative sleep":        {[]Step[struct{}]{{Name: "s", Sleep: -time.Second}}, `step "s": Sleep: -1s: want at least 1ms`},
		"timer with reply":      {[]Step[struct{}]{{Name: "s", Until: until, OnSuccess: func(*struct{}, Reply) error { return nil }}}, `step "s": SuccessReply, FailureReply or OnSuccess is set: a timer step takes no reply`},
		"timer with timeout":    {[]Step[struct{}]{{Name: "s", Sleep: time.Second, Timeout: time.Second}}, `step "s": Timeout: a timer step's time is its Sleep or Until`},
		"timer compensation":    {[]Step[struct{}]{{Name: "s", Sleep: time.Second, Compensation: cmd}}, `step "s": Compensation: a timer step has nothing to undo`},
		"retriable compensated": {[]Step[struct{}]{{Name: "r", Command: cmd, Retriable: true, Compensation: cmd}}, `step "r": Compensation: a Retriable step is retried until it succeeds, never undone`},
		"retriable comp reply":  {[]Step[struct{}]{{Name: "r", Command: cmd, Retriable: true, CompensatedReply: "x"}}, `step "r": CompensationTimeout, CompensatedReply or CompensationFailedReply is set`},
		"after the pivot":       {[]Step[struct{}]{{Name: "r", Command: cmd, Retriable: true}, first}, `step "first" follows Retriable step "r": after the first Retriable step (the pivot) only Retriable steps or timers may follow`},
		"wait after the pivot":  {[]Step[struct{}]{{Name: "r", Command: cmd, Retriable: true}, {Name: "w", WaitFor: "e"}}, `step "w" follows Retriable step "r"`},
	} {
		t.Run(name, func(t *testing.T) {
			d, err := Define("x", tc.steps...)
			require.ErrorContains(t, err, `saga: "x" `+tc.want)
			require.Nil(t, d)
		})
	}
	// Valid: compensated steps, a wait, a timer, the pivot, retriable
	// steps and timers after it; no Command nor NoCompensation needed for
	// waits and timers, no NoCompensation for Retriable steps.
	d, err := Define("x", first, Step[struct{}]{Name: "w", WaitFor: "e"}, Step[struct{}]{Name: "s", Sleep: time.Second},
		Step[struct{}]{Name: "r", Command: cmd, Retriable: true}, Step[struct{}]{Name: "u", Until: until},
		Step[struct{}]{Name: "r2", Command: cmd, Retriable: true})
	require.NoError(t, err)
	m := d.Mermaid()
	for _, want := range []string{
		"w --> s: event e\n", "w --> undo_first: event w.failed\n", "w --> undo_first: no event in 1m0s\n", "note right of w: waits for e\n",
		"s --> r: timer, after 1s\n", "u --> r2: timer, at Until(data)\n",
		"r --> u: r.succeeded\n", "r --> r: r.failed or timeout 1m0s (retry)\n", "r --> Stuck: retries exhausted\n",
		"note right of Stuck: millwright saga resolve ID (retry or skip)",
	} {
		require.Contains(t, m, want)
	}
	require.False(t, strings.Contains(m, "undo_w"), "a wait has no compensation")
	require.Equal(t, "e", d.steps[1].SuccessReply)
}

// A saga may begin with a waiting step: Start sends nothing and records
// the wait.
func TestDecideStartWithAWait(t *testing.T) {
	def := MustDefine("w", Step[waitData]{Name: "approval", WaitFor: "approved", Timeout: time.Minute})
	d := decider[waitData]{def: def, cfg: Config{ReplyTopic: "w_replies", ReplyShards: 1}}
	tr, err := d.decideStart("o-1", waitData{}, t0)
	require.NoError(t, err)
	require.Empty(t, tr.events)
	require.Equal(t, []string{"approval:wait:1"}, kinds(tr))
	require.Equal(t, t0.Add(time.Minute), tr.in.deadline.Time)
	require.True(t, tr.in.awaiting)
	r, err := d.signalReply("o-1", "approved", nil)
	require.NoError(t, err)
	tr.in.version = 1
	tr = decideW(t, d, tr.in, input{reply: r}, history{})
	require.Equal(t, []string{"approval:reply:1", "approval:completed:0"}, kinds(tr))
}
