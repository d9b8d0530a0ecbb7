package saga_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

func TestDefineRejectsInvalidDefinitions(t *testing.T) {
	t.Parallel()
	cmd := func(struct{}) (saga.Command, error) { return saga.Command{Topic: "t"}, nil }
	for name, tc := range map[string]struct {
		name  string
		steps []saga.Step[struct{}]
		want  string
	}{
		"bad name":        {name: "a b", steps: []saga.Step[struct{}]{{Name: "s", Command: cmd, NoCompensation: true}}, want: `name "a b"`},
		"no steps":        {name: "x", want: "no steps"},
		"duplicate step":  {name: "x", steps: []saga.Step[struct{}]{{Name: "s", Command: cmd, Compensation: cmd}, {Name: "s", Command: cmd, Compensation: cmd}}, want: "used by an earlier step"},
		"nil command":     {name: "x", steps: []saga.Step[struct{}]{{Name: "s", NoCompensation: true}}, want: "Command is nil"},
		"same replies":    {name: "x", steps: []saga.Step[struct{}]{{Name: "s", Command: cmd, NoCompensation: true, SuccessReply: "r", FailureReply: "r"}}, want: "must differ"},
		"tiny timeout":    {name: "x", steps: []saga.Step[struct{}]{{Name: "s", Command: cmd, NoCompensation: true, Timeout: time.Microsecond}}, want: "want at least 1ms"},
		"bad retry":       {name: "x", steps: []saga.Step[struct{}]{{Name: "s", Command: cmd, NoCompensation: true, Retry: retry.Policy{Multiplier: 0.5}}}, want: "Multiplier"},
		"empty step name": {name: "x", steps: []saga.Step[struct{}]{{Command: cmd, NoCompensation: true}}, want: `Name ""`},
		// A step that keeps its effect after the saga gave up must say so.
		"no compensation declared": {name: "x", steps: []saga.Step[struct{}]{{Name: "undo", Command: cmd, Compensation: cmd}, {Name: "ship", Command: cmd}},
			want: `saga: "x" step "ship": no Compensation: set Compensation to the command that undoes the step, or NoCompensation: true`},
		"both declared": {name: "x", steps: []saga.Step[struct{}]{{Name: "ship", Command: cmd, Compensation: cmd, NoCompensation: true}},
			want: `step "ship": both Compensation and NoCompensation are set`},
	} {
		t.Run(name, func(t *testing.T) {
			d, err := saga.Define(tc.name, tc.steps...)
			require.ErrorContains(t, err, tc.want)
			require.Nil(t, d)
		})
	}
	require.Panics(t, func() { saga.MustDefine[struct{}]("x") })
	// Either declaration is enough.
	_, err := saga.Define("x", saga.Step[struct{}]{Name: "a", Command: cmd, Compensation: cmd}, saga.Step[struct{}]{Name: "b", Command: cmd, NoCompensation: true})
	require.NoError(t, err)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations())
	def := saga.MustDefine("x", saga.Step[struct{}]{Name: "s", Command: func(struct{}) (saga.Command, error) { return saga.Command{Topic: "t"}, nil }, NoCompensation: true})
	_, err := saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{BatchSize: 20000})
	require.ErrorContains(t, err, "BatchSize 20000")
	_, err = saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{PollInterval: time.Microsecond})
	require.ErrorContains(t, err, "PollInterval")
	_, err = saga.NewOrchestrator(postgres.From((*sql.DB)(nil)), def, saga.Config{})
	require.ErrorIs(t, err, postgres.ErrNoDB)
	_, err = saga.NewOrchestrator(postgres.From((*pgxpool.Pool)(nil)), def, saga.Config{})
	require.ErrorIs(t, err, postgres.ErrNoDB)
	_, err = saga.NewOrchestrator[struct{}](postgres.From(s.DB), nil, saga.Config{})
	require.ErrorContains(t, err, "saga.Define")
	o, err := saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{})
	require.NoError(t, err)
	require.Equal(t, "x_replies", o.ReplyTopic())
	require.Equal(t, []string{"x_replies"}, o.ReplyTopics())
	require.Equal(t, []string{"s"}, o.Definition().Steps())
	for _, n := range []int{-1, 65} {
		_, err = saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{ReplyShards: n})
		require.ErrorContains(t, err, fmt.Sprintf("ReplyShards %d: want 1..64", n))
	}
	// Every field's error at once.
	_, err = saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{ReplyShards: 65, BatchSize: 20000})
	require.ErrorContains(t, err, "ReplyShards 65")
	require.ErrorContains(t, err, "BatchSize 20000")
	o, err = saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{ReplyShards: 3})
	require.NoError(t, err)
	require.Equal(t, []string{"x_replies", "x_replies_1", "x_replies_2"}, o.ReplyTopics())
}

// Replies that cannot belong to the saga type fail permanently (for the
// dead-letter path) and change nothing.
func TestHandleReplyRejectsForeignReplies(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	s.DB.SetMaxOpenConns(4)
	tp := newTopics()
	o, err := saga.NewOrchestrator(postgres.From(s.DB), ordersDef(t, tp, defOpts{}), saga.Config{ReplyTopic: tp.replies})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, o.StartOutsideTx(ctx, postgres.From(s.DB), "o-1", Order{ID: "o-1"}))

	cmd := commandFor("o-1", reserve, saga.PhaseForward, "1", tp.replies)
	for name, tc := range map[string]struct {
		edit func(m map[string]string)
		want string
	}{
		"no saga id":   {func(m map[string]string) { delete(m, metadata.SagaID) }, "participants must copy the command's saga keys"},
		"other type":   {func(m map[string]string) { m[metadata.SagaType] = "invoices" }, "own reply topic"},
		"unknown step": {func(m map[string]string) { m[metadata.SagaStep] = "teleport" }, `unknown step "teleport"`},
		"bad phase":    {func(m map[string]string) { m[metadata.SagaPhase] = "sideways" }, `want "forward" or "compensation"`},
		"bad attempt":  {func(m map[string]string) { m[metadata.SagaAttempt] = "x" }, "positive integer"},
		"bad type":     {func(m map[string]string) { m[metadata.SagaReplyType] = "reserve_inventory.maybe" }, `want "reserve_inventory.succeeded" or "reserve_inventory.failed"`},
		"unknown saga": {func(m map[string]string) { m[metadata.SagaID] = "o-404" }, "instance not found"},
	} {
		t.Run(name, func(t *testing.T) {
			reply, err := saga.NewReply(cmd, reserve+".succeeded", nil)
			require.NoError(t, err)
			tc.edit(reply.Metadata)
			err = o.HandleReply(reply)
			require.ErrorContains(t, err, tc.want)
			require.True(t, failure.IsPermanent(err), "permanent: %v", err)
		})
	}
	info, h, err := saga.Get(ctx, postgres.From(s.DB), "o-1")
	require.NoError(t, err)
	require.EqualValues(t, 1, info.Version)
	require.Len(t, h, 1)
}
