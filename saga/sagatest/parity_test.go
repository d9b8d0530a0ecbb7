package sagatest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

// TestOrchestratorParity feeds the same inputs to a Simulator and to an
// Orchestrator on Postgres, and requires the same instance, history and
// commands after each one: the simulator is the orchestrator without its
// I/O. (It needs Postgres; the Sim tests do not.)
func TestOrchestratorParity(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, outbox.Migrations(), saga.Migrations())
	db := postgres.From(s.DB)
	def := simDef(t)
	o, err := saga.NewOrchestrator(db, def, saga.Config{})
	require.NoError(t, err)
	sim := newSim(t, def)

	// reply sends the same reply to the newest command of id's step in
	// phase, to both.
	reply := func(id, step, phase, typ string, payload any, reason string) {
		t.Helper()
		var cmd *sagatest.Command
		for _, c := range sim.Sent(id) {
			if c.Step == step && c.Phase == phase {
				c := c
				cmd = &c
			}
		}
		require.NotNil(t, cmd, "no %s command of %s sent to %s", phase, step, id)
		msg, err := saga.NewReply(cmd.Message, typ, payload)
		require.NoError(t, err)
		if reason != "" {
			msg.Metadata.Set(metadata.SagaError, reason)
		}
		require.NoError(t, o.HandleReply(msg.Copy()))
		require.NoError(t, sim.HandleReply(msg))
	}
	// fire fires id's deadline in both.
	fire := func(id string) {
		t.Helper()
		info, err := sim.Info(id)
		require.NoError(t, err)
		require.False(t, info.Deadline.IsZero(), "%s has no deadline", id)
		require.NoError(t, sim.Advance(info.Deadline.Sub(sim.Now())))
		_, err = s.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - interval '1 millisecond' WHERE id = $1`, id)
		require.NoError(t, err)
		n, err := o.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	same := func(id, after string) {
		t.Helper()
		want, hist, err := saga.Get(ctx, db, id)
		require.NoError(t, err)
		got, err := sim.Info(id)
		require.NoError(t, err)
		require.JSONEq(t, string(want.Data), string(got.Data), "data of %s after %s", id, after)
		require.Equal(t, want.Deadline.IsZero(), got.Deadline.IsZero(), "deadline of %s after %s", id, after)
		for _, in := range []*saga.Info{&want, &got} {
			in.Data, in.CreatedAt, in.UpdatedAt, in.Deadline = nil, time.Time{}, time.Time{}, time.Time{}
		}
		require.Equal(t, want, got, "instance %s after %s", id, after)
		simHist := sim.History(id)
		require.Len(t, simHist, len(hist), "history of %s after %s", id, after)
		for i := range hist {
			hist[i].At, simHist[i].At = time.Time{}, time.Time{}
		}
		require.Equal(t, hist, simHist, "history of %s after %s", id, after)
		rows, err := s.DB.Query(`SELECT topic, event_type, payload::text, metadata::text FROM millwright_outbox
			WHERE aggregate_type = 'saga' AND aggregate_id = $1 ORDER BY id`, id)
		require.NoError(t, err)
		defer rows.Close()
		sent := sim.Sent(id)
		i := 0
		for ; rows.Next(); i++ {
			var topic, typ, payload, md string
			require.NoError(t, rows.Scan(&topic, &typ, &payload, &md))
			require.Less(t, i, len(sent), "the orchestrator sent more commands to %s after %s", id, after)
			var meta map[string]string
			require.NoError(t, json.Unmarshal([]byte(md), &meta))
			c := sent[i]
			require.Equal(t, topic, c.Topic)
			require.Equal(t, typ, c.Type)
			require.JSONEq(t, payload, string(c.Payload))
			for _, k := range []string{metadata.SagaID, metadata.SagaType, metadata.SagaStep, metadata.SagaPhase, metadata.SagaAttempt, metadata.SagaReplyTo} {
				require.Equal(t, meta[k], c.Message.Metadata.Get(k), "%s of command %d of %s", k, i, id)
			}
		}
		require.NoError(t, rows.Err())
		require.Equal(t, len(sent), i, "commands of %s after %s", id, after)
	}
	start := func(id string) {
		t.Helper()
		require.NoError(t, o.StartOutsideTx(ctx, db, id, simOrder{ID: id}))
		require.NoError(t, sim.Start(id, simOrder{ID: id}))
		same(id, "start")
	}
	type input struct {
		what string
		do   func(id string)
	}
	ok := func(step string, payload any) input {
		return input{step + " succeeded", func(id string) { reply(id, step, saga.PhaseForward, step+".succeeded", payload, "") }}
	}
	fail := func(step string) input {
		return input{step + " failed", func(id string) { reply(id, step, saga.PhaseForward, step+".failed", nil, "no "+step) }}
	}
	undone := func(step string) input {
		return input{step + " compensated", func(id string) { reply(id, step, saga.PhaseCompensation, step+".compensated", nil, "") }}
	}
	notUndone := func(step string) input {
		return input{step + " compensation failed", func(id string) {
			reply(id, step, saga.PhaseCompensation, step+".compensation_failed", nil, "cannot undo "+step)
		}}
	}
	deadline := input{"deadline", fire}
	resolve := func(a saga.ResolveAction) input {
		return input{"resolve " + string(a), func(id string) {
			want, err := saga.Resolve(ctx, db, id, a, "fixed by hand", false)
			require.NoError(t, err)
			got, err := sim.Resolve(id, a, "fixed by hand")
			require.NoError(t, err)
			require.Equal(t, want.Description, got.Description)
		}}
	}

	// One saga after the other: each ends with no deadline, so that the
	// simulator's clock fires only the deadline fire names.
	for _, tc := range []struct {
		id     string
		inputs []input
		end    saga.State
	}{
		{"all-succeed", []input{ok("reserve", map[string]string{"reservation": "r-1"}), ok("charge", nil), ok("ship", nil),
			ok("ship", nil)}, saga.StateCompleted},
		{"fail-retry", []input{ok("reserve", nil), fail("charge"), notUndone("reserve"), deadline, undone("reserve"),
			undone("reserve")}, saga.StateCompensated},
		{"late-success", []input{ok("reserve", nil), deadline, undone("charge"), undone("reserve"), ok("charge", nil),
			ok("charge", nil), undone("charge"), fail("reserve")}, saga.StateCompensated},
		// Attempt 1 fails, 2 and 3 time out (each after its backoff).
		{"stuck", []input{ok("reserve", nil), ok("charge", nil), fail("ship"), notUndone("charge"), deadline, deadline,
			deadline, deadline, undone("charge"), ok("ship", nil)}, saga.StateStuck},
		{"resolved", []input{ok("reserve", nil), ok("charge", nil), fail("ship"), notUndone("charge"), deadline, notUndone("charge"),
			deadline, notUndone("charge"), resolve(saga.ResolveRetry), deadline, notUndone("charge"), deadline,
			notUndone("charge"), deadline, notUndone("charge"), resolve(saga.ResolveSkip), deadline, undone("reserve")},
			saga.StateCompensated},
	} {
		start(tc.id)
		for i, in := range tc.inputs {
			in.do(tc.id)
			same(tc.id, fmt.Sprintf("input %d (%s)", i, in.what))
		}
		require.Equal(t, tc.end, sim.State(tc.id), tc.id)
	}
}
