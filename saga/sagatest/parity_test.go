package sagatest_test

import (
	"context"
	"database/sql"
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

// The parity tests feed the same inputs to a Simulator and to an
// Orchestrator on Postgres, and require the same instance, history and
// commands after each one: the simulator is the orchestrator without its
// I/O. (They need Postgres; their names keep them out of -run Sim.)

// parity is an orchestrator on Postgres and a simulator of one definition.
type parity struct {
	t   *testing.T
	ctx context.Context
	s   *pgtest.Schema
	db  postgres.DB
	o   *saga.Orchestrator[simOrder]
	sim *sagatest.Simulator[simOrder]
}

func newParity(t *testing.T, def *saga.Definition[simOrder]) *parity {
	s := pgtest.New(t, outbox.Migrations(), saga.Migrations())
	db := postgres.From(s.DB)
	o, err := saga.NewOrchestrator(db, def, saga.Config{})
	require.NoError(t, err)
	return &parity{t: t, ctx: context.Background(), s: s, db: db, o: o, sim: newSim(t, def)}
}

// input is one input to both, to saga id.
type input struct {
	what string
	do   func(p *parity, id string)
}

// run starts saga id in both, applies inputs, comparing after each, and
// requires the saga to end in state end. Run one saga to its end before
// the next: the simulator's clock then fires only the deadline fire names.
func (p *parity) run(id string, end saga.State, inputs ...input) {
	t := p.t
	t.Helper()
	require.NoError(t, p.o.StartOutsideTx(p.ctx, p.db, id, simOrder{ID: id}))
	require.NoError(t, p.sim.Start(id, simOrder{ID: id}))
	p.same(id, "start")
	for i, in := range inputs {
		in.do(p, id)
		p.same(id, fmt.Sprintf("input %d (%s)", i, in.what))
	}
	require.Equal(t, end, p.sim.State(id), id)
}

// reply sends the same reply to the newest command of id's step in phase,
// to both.
func (p *parity) reply(id, step, phase, typ string, payload any, reason string) {
	t := p.t
	t.Helper()
	var cmd *sagatest.Command
	for _, c := range p.sim.Sent(id) {
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
	require.NoError(t, p.o.HandleReply(msg.Copy()))
	require.NoError(t, p.sim.HandleReply(msg))
}

// same requires the same instance, history and commands of id in both.
func (p *parity) same(id, after string) {
	t := p.t
	t.Helper()
	want, hist, err := saga.Get(p.ctx, p.db, id)
	require.NoError(t, err)
	got, err := p.sim.Info(id)
	require.NoError(t, err)
	require.JSONEq(t, string(want.Data), string(got.Data), "data of %s after %s", id, after)
	require.Equal(t, want.Deadline.IsZero(), got.Deadline.IsZero(), "deadline of %s after %s", id, after)
	for _, in := range []*saga.Info{&want, &got} {
		in.Data, in.CreatedAt, in.UpdatedAt, in.Deadline = nil, time.Time{}, time.Time{}, time.Time{}
		timesOut(in)
	}
	require.Equal(t, want, got, "instance %s after %s", id, after)
	simHist := p.sim.History(id)
	require.Len(t, simHist, len(hist), "history of %s after %s", id, after)
	for i := range hist {
		hist[i].At, simHist[i].At = time.Time{}, time.Time{}
		if hist[i].Kind == saga.KindTimer { // when it fires, by each side's clock
			hist[i].Detail, simHist[i].Detail = "", ""
		}
	}
	require.Equal(t, hist, simHist, "history of %s after %s", id, after)
	rows, err := p.s.DB.Query(`SELECT topic, event_type, payload::text, metadata::text FROM millwright_outbox
		WHERE aggregate_type = 'saga' AND aggregate_id = $1 ORDER BY id`, id)
	require.NoError(t, err)
	defer rows.Close()
	sent := p.sim.Sent(id)
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

// timesOut leaves in's branch deadlines (each side's clock) out of a
// comparison, keeping whether they are set.
func timesOut(in *saga.Info) {
	if in.Branches == nil {
		return
	}
	b := make(map[string]saga.BranchInfo, len(in.Branches))
	for k, v := range in.Branches {
		if !v.Deadline.IsZero() {
			v.Deadline = time.Unix(1, 0)
		}
		b[k] = v
	}
	in.Branches = b
}

func ok(step string, payload any) input {
	return input{step + " succeeded", func(p *parity, id string) {
		p.reply(id, step, saga.PhaseForward, step+".succeeded", payload, "")
	}}
}

func fail(step string) input {
	return input{step + " failed", func(p *parity, id string) {
		p.reply(id, step, saga.PhaseForward, step+".failed", nil, "no "+step)
	}}
}

func undone(step string) input {
	return input{step + " compensated", func(p *parity, id string) {
		p.reply(id, step, saga.PhaseCompensation, step+".compensated", nil, "")
	}}
}

func notUndone(step string) input {
	return input{step + " compensation failed", func(p *parity, id string) {
		p.reply(id, step, saga.PhaseCompensation, step+".compensation_failed", nil, "cannot undo "+step)
	}}
}

// deadline fires id's deadline in both.
var deadline = input{"deadline", func(p *parity, id string) {
	t := p.t
	t.Helper()
	info, err := p.sim.Info(id)
	require.NoError(t, err)
	require.False(t, info.Deadline.IsZero(), "%s has no deadline", id)
	require.NoError(t, p.sim.Advance(info.Deadline.Sub(p.sim.Now())))
	// The orchestrator's deadline comes by moving the instance's times
	// back (the instance's deadline, and its branches', by as much).
	var at time.Time
	var branches sql.NullString
	require.NoError(t, p.s.DB.QueryRow(`SELECT deadline_at, branches::text FROM millwright_saga_instances WHERE id = $1`, id).Scan(&at, &branches))
	shift := time.Until(at) + time.Millisecond
	if branches.Valid {
		var b map[string]map[string]any
		require.NoError(t, json.Unmarshal([]byte(branches.String), &b))
		for _, e := range b {
			if d, ok := e["deadline"].(string); ok {
				bt, err := time.Parse(time.RFC3339Nano, d)
				require.NoError(t, err)
				e["deadline"] = bt.Add(-shift)
			}
		}
		raw, err := json.Marshal(b)
		require.NoError(t, err)
		branches.String = string(raw)
	}
	_, err = p.s.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = $2, branches = $3::jsonb WHERE id = $1`, id, at.Add(-shift), branches)
	require.NoError(t, err)
	n, err := p.o.RunOnce(p.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}}

func resolve(a saga.ResolveAction) input {
	return input{"resolve " + string(a), func(p *parity, id string) {
		want, err := saga.Resolve(p.ctx, p.db, id, a, "fixed by hand", false)
		require.NoError(p.t, err)
		got, err := p.sim.Resolve(id, a, "fixed by hand")
		require.NoError(p.t, err)
		require.Equal(p.t, want.Description, got.Description)
	}}
}

func TestOrchestratorParity(t *testing.T) {
	t.Parallel()
	p := newParity(t, simDef(t))
	p.run("all-succeed", saga.StateCompleted,
		ok("reserve", map[string]string{"reservation": "r-1"}), ok("charge", nil), ok("ship", nil), ok("ship", nil))
	p.run("fail-retry", saga.StateCompensated,
		ok("reserve", nil), fail("charge"), notUndone("reserve"), deadline, undone("reserve"), undone("reserve"))
	p.run("late-success", saga.StateCompensated,
		ok("reserve", nil), deadline, undone("charge"), undone("reserve"), ok("charge", nil), ok("charge", nil),
		undone("charge"), fail("reserve"))
	// Attempt 1 fails, 2 and 3 time out (each after its backoff).
	p.run("stuck", saga.StateStuck,
		ok("reserve", nil), ok("charge", nil), fail("ship"), notUndone("charge"), deadline, deadline,
		deadline, deadline, undone("charge"), ok("ship", nil))
	p.run("resolved", saga.StateCompensated,
		ok("reserve", nil), ok("charge", nil), fail("ship"), notUndone("charge"), deadline, notUndone("charge"),
		deadline, notUndone("charge"), resolve(saga.ResolveRetry), deadline, notUndone("charge"), deadline,
		notUndone("charge"), deadline, notUndone("charge"), resolve(saga.ResolveSkip), deadline, undone("reserve"))
}
