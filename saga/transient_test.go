package saga_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// An OnSuccess that fails for a moment (the error is not a panic and the
// position is in the definition) fails the reply's handling for
// redelivery, as Definition's doc says: the redelivered reply moves the
// saga on. Setting such an instance aside, or dead-lettering its success
// reply (and later compensating a step that succeeded), is for decisions
// that can never be made.
func TestOnSuccessErrorIsRetriedByRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	var failures atomic.Int64
	failures.Store(1)
	def, err := saga.Define("flaky",
		saga.Step[asideData]{
			Name: "first",
			Command: func(d asideData) (saga.Command, error) {
				return saga.Command{Topic: "flaky.first", Type: "first.v1", Payload: d}, nil
			},
			OnSuccess: func(*asideData, saga.Reply) error {
				if failures.Add(-1) >= 0 {
					return errors.New("the ledger is down for a moment")
				}
				return nil
			},
			NoCompensation: true, Timeout: time.Hour,
		},
		saga.Step[asideData]{
			Name: "second",
			Command: func(d asideData) (saga.Command, error) {
				return saga.Command{Topic: "flaky.second", Type: "second.v1", Payload: d}, nil
			},
			NoCompensation: true, Timeout: time.Hour,
		},
	)
	require.NoError(t, err)
	o, err := saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{})
	require.NoError(t, err)
	tx, err := schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, o.Start(ctx, postgres.SQLTx(tx), "f1", asideData{ID: "f1"}))
	require.NoError(t, tx.Commit())

	reply := message.NewMessage(watermill.NewUUID(), nil)
	for k, v := range map[string]string{metadata.SagaID: "f1", metadata.SagaType: "flaky", metadata.SagaStep: "first",
		metadata.SagaPhase: saga.PhaseForward, metadata.SagaAttempt: "1", metadata.SagaReplyType: "first.succeeded"} {
		reply.Metadata.Set(k, v)
	}
	err = o.HandleReply(reply)
	require.Error(t, err)
	require.False(t, failure.IsPermanent(err), "a passing error must be redelivered, not dead-lettered: %v", err)
	info, _, err := saga.Get(ctx, postgres.From(schema.DB), "f1")
	require.NoError(t, err)
	require.Equal(t, saga.StateRunning, info.State)
	require.Equal(t, "first", info.Step, "nothing changed")

	require.NoError(t, o.HandleReply(reply), "the redelivery")
	info, _, err = saga.Get(ctx, postgres.From(schema.DB), "f1")
	require.NoError(t, err)
	require.Equal(t, saga.StateRunning, info.State)
	require.Equal(t, "second", info.Step, "the redelivered success moved the saga on")
}
