package sagatest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

func TestWaitState(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, data) VALUES ('s-1', 'x', 'running', '{}')`)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = sagatest.WaitState(ctx, s.DB, "s-1", saga.StateCompleted)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, `saga "s-1" is running`)

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		info, err := sagatest.WaitState(ctx, s.DB, "s-1", saga.StateCompleted)
		if err == nil && info.State != saga.StateCompleted {
			err = context.Canceled
		}
		done <- err
	}()
	_, err = s.DB.Exec(`UPDATE millwright_saga_instances SET state = 'completed' WHERE id = 's-1'`)
	require.NoError(t, err)
	require.NoError(t, <-done)

	ctx2, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	_, err = sagatest.WaitState(ctx2, s.DB, "missing", saga.StateCompleted)
	require.ErrorContains(t, err, "never read")
}
