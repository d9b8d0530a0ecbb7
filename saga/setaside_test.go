package saga_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

type asideData struct{ ID string }

// asideDef is a two-step saga whose first step's compensation panics for
// the saga "panics" (the definition's code failing on one record).
func asideDef(t *testing.T, compensations *int) *saga.Definition[asideData] {
	t.Helper()
	def, err := saga.Define("aside",
		saga.Step[asideData]{
			Name: "first",
			Command: func(d asideData) (saga.Command, error) {
				return saga.Command{Topic: "aside.first", Type: "first.v1", Payload: d}, nil
			},
			OnSuccess: func(_ *asideData, r saga.Reply) error {
				if string(r.Payload) == "poison" {
					panic("boom: OnSuccess cannot read the reply")
				}
				return nil
			},
			Compensation: func(d asideData) (saga.Command, error) {
				if d.ID == "panics" {
					panic("boom: compensation of " + d.ID)
				}
				*compensations++
				return saga.Command{Topic: "aside.first", Type: "first.undo.v1", Payload: d}, nil
			},
			Timeout: time.Hour, CompensationTimeout: time.Hour,
		},
		saga.Step[asideData]{
			Name: "second",
			Command: func(d asideData) (saga.Command, error) {
				return saga.Command{Topic: "aside.second", Type: "second.v1", Payload: d}, nil
			},
			NoCompensation: true, Timeout: time.Hour,
		},
	)
	require.NoError(t, err)
	return def
}

// A saga instance whose position is not in its definition, and one whose
// compensation panics, are set aside as stuck (last_error and a stuck
// history row say why, the listing shows them, the panic is counted);
// the orchestrator's loop goes on firing the other instances' deadlines,
// in the same round and after. Before, the first made RunOnce panic
// (index out of range) in Run's goroutine, and the process died.
func TestRunSetsAsideAnInstanceItCannotDecideOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	compensations := 0 // only Run's goroutine calls the compensations
	def := asideDef(t, &compensations)
	reg := prometheus.NewRegistry()
	logs := newSyncLogger()
	o, err := saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{PollInterval: 10 * time.Millisecond, Registerer: reg, Logger: logs})
	require.NoError(t, err)
	start := func(id string) {
		tx, err := schema.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, o.Start(ctx, postgres.SQLTx(tx), id, asideData{ID: id}))
		require.NoError(t, tx.Commit())
	}
	for _, id := range []string{"good", "outofrange", "panics"} {
		start(id)
	}
	// A definition that lost steps while "outofrange" ran; every deadline
	// passed.
	_, err = schema.DB.Exec(`UPDATE millwright_saga_instances SET current_step = 7 WHERE id = 'outofrange'`)
	require.NoError(t, err)
	_, err = schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - interval '1 second'`)
	require.NoError(t, err)

	stop := runBackground(t, "orchestrator", o.Run, o.Close)
	defer stop()

	wait := func(id string, want saga.State) saga.Info {
		t.Helper()
		var last saga.Info
		poll.Until(t, time.Minute, func() bool {
			info, _, err := saga.Get(ctx, postgres.From(schema.DB), id)
			last = info
			return err == nil && info.State == want
		}, "saga %s: want %s, got %+v", id, want, later(func() string { return fmt.Sprintf("%+v", last) }))
		return last
	}
	// The good one's timeout fired: its compensation was sent.
	wait("good", saga.StateCompensating)
	bad := wait("outofrange", saga.StateStuck)
	require.Contains(t, bad.LastError, "set aside")
	require.Contains(t, bad.LastError, "current_step is step index 7, but the definition has 2 step(s)")
	require.True(t, bad.Deadline.IsZero(), "a set-aside saga has no deadline: it is not fired again")
	pan := wait("panics", saga.StateStuck)
	require.Contains(t, pan.LastError, "recovered from a panic: boom: compensation of panics")

	for _, id := range []string{"outofrange", "panics"} {
		h, err := saga.History(ctx, postgres.From(schema.DB), id)
		require.NoError(t, err)
		require.Equal(t, saga.KindStuck, h[len(h)-1].Kind, "%s: %+v", id, h)
	}
	stuck, err := saga.List(ctx, postgres.From(schema.DB), saga.Filter{Type: "aside", State: saga.StateStuck})
	require.NoError(t, err)
	var ids []string
	for _, in := range stuck {
		ids = append(ids, in.ID)
	}
	require.ElementsMatch(t, []string{"outofrange", "panics"}, ids)

	require.Equal(t, outbox.MetricLoopPanics, saga.MetricLoopPanics, "one series for every loop")
	require.Equal(t, 1.0, metricValue(t, reg, saga.MetricLoopPanics, map[string]string{"component": "saga.Orchestrator"}), "the panic is counted once: the saga is not fired again")
	require.Equal(t, 2.0, metricValue(t, reg, saga.MetricStuck, map[string]string{"type": "aside"}))
	logs.waitErrorsLogged(t, "the panic logged with its saga", func(ms []watermill.CapturedMessage) bool {
		for _, m := range ms {
			if strings.Contains(m.Msg, "recovered from a panic") && m.Fields["saga_id"] == "panics" {
				return true
			}
		}
		return false
	})

	// The loop still runs: a saga started now has its deadline fired.
	start("later")
	_, err = schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - interval '1 second' WHERE id = 'later'`)
	require.NoError(t, err)
	wait("later", saga.StateCompensating)
	require.Equal(t, 2, compensations, "good's and later's compensations were built")
}

// A reply to an instance whose position is not in the definition is
// refused with a permanent error naming the position (before, the current
// compensation reply of an instance whose resume_step was out of range
// panicked in compensateFrom), and so is a reply the definition's code
// panics on (counted), instead of a panic in the router's handler.
func TestReplyToAnInstanceOutOfItsDefinitionIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	compensations := 0
	def := asideDef(t, &compensations)
	reg := prometheus.NewRegistry()
	o, err := saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{Registerer: reg})
	require.NoError(t, err)
	start := func(id string) {
		tx, err := schema.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, o.Start(ctx, postgres.SQLTx(tx), id, asideData{ID: id}))
		require.NoError(t, tx.Commit())
	}
	reply := func(id, phase, typ, payload string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		for k, v := range map[string]string{metadata.SagaID: id, metadata.SagaType: "aside", metadata.SagaStep: "first",
			metadata.SagaPhase: phase, metadata.SagaAttempt: "1", metadata.SagaReplyType: typ} {
			m.Metadata.Set(k, v)
		}
		return m
	}

	start("s1")
	_, err = schema.DB.Exec(`UPDATE millwright_saga_instances SET state = 'compensating', current_step = 0, resume_step = 5, compensation_attempts = 1, awaiting_reply = true WHERE id = 's1'`)
	require.NoError(t, err)
	err = o.HandleReply(reply("s1", saga.PhaseCompensation, "first.compensated", ""))
	require.Error(t, err)
	require.True(t, failure.IsPermanent(err), "%v", err)
	require.True(t, errors.Is(err, saga.ErrUnknownPosition), "%v", err)
	require.Contains(t, err.Error(), "resume_step is step index 5")

	start("s2")
	err = o.HandleReply(reply("s2", saga.PhaseForward, "first.succeeded", "poison"))
	require.Error(t, err)
	require.True(t, failure.IsPermanent(err), "%v", err)
	require.Contains(t, err.Error(), "recovered from a panic: boom: OnSuccess cannot read the reply")
	require.Equal(t, 1.0, metricValue(t, reg, saga.MetricLoopPanics, map[string]string{"component": "saga.Orchestrator"}))
	info, _, err := saga.Get(ctx, postgres.From(schema.DB), "s2")
	require.NoError(t, err)
	require.Equal(t, saga.StateRunning, info.State, "the refused reply changed nothing")
	require.Equal(t, "first", info.Step)
}
