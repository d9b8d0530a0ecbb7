package sagatest_test

import (
	"regexp"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

// signal delivers event typ in the caller's transaction (Signal), to
// both; wantErr says whether both refuse it.
func signal(typ string, payload any, wantErr bool) input {
	return input{"signal " + typ, func(p *parity, id string) {
		err := p.db.InTx(p.ctx, func(tx postgres.Tx) error { return p.o.Signal(p.ctx, tx, id, typ, payload) })
		simErr := p.sim.Signal(id, typ, payload)
		if wantErr {
			require.ErrorIs(p.t, err, saga.ErrNotWaiting)
			require.ErrorIs(p.t, simErr, saga.ErrNotWaiting)
			// The same words, but for the deadline of each side's clock.
			untilRE := regexp.MustCompile(` until \S+:`)
			require.Equal(p.t, untilRE.ReplaceAllString(err.Error(), ""), untilRE.ReplaceAllString(simErr.Error(), ""))
			return
		}
		require.NoError(p.t, err)
		require.NoError(p.t, simErr)
	}}
}

// signalEvent delivers event typ through the transport (SignalEvent's
// event, as the relay would publish it, to HandleReply), to both.
func signalEvent(typ string, payload any) input {
	return input{"signal event " + typ, func(p *parity, id string) {
		ev, err := p.o.SignalEvent(id, typ, payload)
		require.NoError(p.t, err)
		msg := message.NewMessage("event-"+id+"-"+typ, ev.Payload)
		for k, v := range ev.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.Metadata.Set(metadata.EventType, ev.EventType)
		require.NoError(p.t, p.o.HandleReply(msg))
		require.NoError(p.t, p.sim.SignalEvent(id, typ, payload))
	}}
}

func TestOrchestratorParityFlows(t *testing.T) {
	t.Parallel()
	pol := retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute, MaxAttempts: 3}
	def, err := saga.Define("orders",
		saga.Step[simOrder]{Name: "reserve", Command: orderCmd("reserve"), Compensation: orderCmd("release"), Timeout: 10 * time.Second},
		saga.Step[simOrder]{Name: "pay", Parallel: []saga.Step[simOrder]{
			{Name: "charge", Command: orderCmd("charge"), Compensation: orderCmd("refund"), Timeout: 10 * time.Second},
			{Name: "pack", Command: orderCmd("pack"), Compensation: orderCmd("unpack"), Timeout: 20 * time.Second},
		}},
		saga.Step[simOrder]{Name: "approval", WaitFor: "order.approved", Timeout: time.Hour,
			OnSuccess: func(o *simOrder, r saga.Reply) error {
				var body struct{ Reservation string }
				if err := r.Decode(&body); err != nil {
					return err
				}
				o.Reservation = body.Reservation
				return nil
			}},
		saga.Step[simOrder]{Name: "cool", Sleep: 30 * time.Minute},
		saga.Step[simOrder]{Name: "settle", Command: orderCmd("settle"), Retriable: true, Timeout: 10 * time.Second, Retry: pol},
	)
	require.NoError(t, err)
	p := newParity(t, def)
	approved := map[string]string{"reservation": "r-1"}

	p.run("flow-ok", saga.StateCompleted,
		ok("reserve", nil), signal("order.approved", nil, true), ok("pack", nil), ok("charge", nil),
		signal("order.approved", approved, false), signal("order.approved", approved, true), deadline, ok("settle", nil))
	p.run("branch-fails-other-in-flight", saga.StateCompensated,
		ok("reserve", nil), fail("charge"), ok("pack", nil), undone("pack"), undone("reserve"), ok("charge", nil))
	p.run("branch-times-out-other-in-flight", saga.StateCompensated,
		ok("reserve", nil), deadline, ok("pack", nil), undone("pack"), undone("charge"), undone("reserve"),
		ok("charge", nil), undone("charge"), ok("charge", nil))
	p.run("late-branch-after-group-compensated", saga.StateCompensated,
		ok("reserve", nil), ok("charge", nil), deadline, undone("pack"), undone("charge"), undone("reserve"),
		ok("pack", nil), undone("pack"))
	p.run("wait-times-out", saga.StateCompensated,
		ok("reserve", nil), ok("charge", nil), ok("pack", nil), deadline, signal("order.approved", approved, true),
		signalEvent("order.approved", approved), undone("pack"), undone("charge"), undone("reserve"))
	p.run("wait-rejected", saga.StateCompensated,
		ok("reserve", nil), ok("charge", nil), ok("pack", nil), signalEvent("approval.failed", nil),
		undone("pack"), undone("charge"), undone("reserve"))
	p.run("retriable-resolved-retry", saga.StateCompleted,
		ok("reserve", nil), ok("charge", nil), ok("pack", nil), signalEvent("order.approved", approved), deadline,
		fail("settle"), deadline, deadline, deadline, fail("settle"), resolve(saga.ResolveRetry), deadline, fail("settle"),
		ok("settle", nil))
	p.run("retriable-resolved-skip", saga.StateCompleted,
		ok("reserve", nil), ok("charge", nil), ok("pack", nil), signal("order.approved", approved, false), deadline,
		fail("settle"), deadline, fail("settle"), deadline, fail("settle"), resolve(saga.ResolveSkip), deadline)
}
