package runner_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/runner"
)

// bound is how long a test waits for something that must happen.
const bound = 10 * time.Second

func start(t *testing.T, r *runner.Runner, ctx context.Context, loop runner.Loop) <-chan error {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx, loop) }()
	select {
	case <-r.Running():
	case <-time.After(bound):
		t.Fatal("Running was not closed")
	}
	return errc
}

func result(t *testing.T, errc <-chan error) error {
	t.Helper()
	select {
	case err := <-errc:
		return err
	case <-time.After(bound):
		t.Fatal("Run did not return")
		return nil
	}
}

func TestCloseDrainsTheRoundInFlight(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	inRound, finish := make(chan struct{}), make(chan struct{})
	var ctxErr error
	errc := start(t, r, context.Background(), func(ctx context.Context, draining <-chan struct{}) error {
		close(inRound)
		<-finish // the round in flight
		ctxErr = ctx.Err()
		<-draining
		return nil
	})
	<-inRound
	closed := make(chan struct{})
	go func() { _ = r.Close(); close(closed) }()
	select {
	case <-r.Draining():
	case <-time.After(bound):
		t.Fatal("Close did not ask the loop to drain")
	}
	select {
	case <-closed:
		t.Fatal("Close returned while the round was in flight")
	default:
	}
	close(finish)
	require.NoError(t, result(t, errc))
	<-closed
	require.NoError(t, ctxErr, "a drain within CloseTimeout does not cancel the round")
}

func TestCloseCancelsAfterTheTimeout(t *testing.T) {
	t.Parallel()
	r := runner.New("test", 20*time.Millisecond)
	errc := start(t, r, context.Background(), func(ctx context.Context, _ <-chan struct{}) error {
		<-ctx.Done() // a round that ignores draining
		return ctx.Err()
	})
	require.NoError(t, r.Close())
	require.NoError(t, result(t, errc), "a cancellation by Close is not Run's error")
}

func TestZeroCloseTimeoutCancelsAtOnce(t *testing.T) {
	t.Parallel()
	r := runner.New("test", 0)
	errc := start(t, r, context.Background(), func(ctx context.Context, _ <-chan struct{}) error {
		<-ctx.Done()
		return nil
	})
	require.NoError(t, r.Close())
	require.NoError(t, result(t, errc))
}

func TestCancellingCtxStopsWithoutDrain(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	ctx, cancel := context.WithCancel(context.Background())
	errc := start(t, r, ctx, func(ctx context.Context, draining <-chan struct{}) error {
		<-ctx.Done()
		select {
		case <-draining:
			return errors.New("draining closed without Close")
		default:
		}
		return ctx.Err()
	})
	cancel()
	require.ErrorIs(t, result(t, errc), context.Canceled, "the parent's cancellation is the loop's to report")
	require.NoError(t, r.Close(), "Close after Run returned")
}

func TestLoopErrorIsRunError(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	boom := errors.New("boom")
	require.ErrorIs(t, r.Run(context.Background(), func(context.Context, <-chan struct{}) error { return boom }), boom)
	select {
	case <-r.Done():
	default:
		t.Fatal("Done is not closed after Run returned")
	}
}

func TestRunTwice(t *testing.T) {
	t.Parallel()
	r := runner.New("outbox.Relay", bound)
	errc := start(t, r, context.Background(), func(ctx context.Context, draining <-chan struct{}) error {
		<-draining
		return nil
	})
	err := r.Run(context.Background(), func(context.Context, <-chan struct{}) error {
		t.Error("the second Run called the loop")
		return nil
	})
	require.ErrorIs(t, err, runner.ErrRunTwice)
	require.ErrorContains(t, err, "outbox.Relay")
	require.NoError(t, r.Close())
	require.NoError(t, result(t, errc))
	require.NoError(t, r.Run(context.Background(), nil), "Run after Close returns at once, also after a Run")
}

func TestRunAfterCloseReturnsAtOnce(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	require.NoError(t, r.Close())
	require.NoError(t, r.Run(context.Background(), func(context.Context, <-chan struct{}) error {
		t.Error("Run after Close called the loop")
		return nil
	}))
	select {
	case <-r.Running():
	default:
		t.Fatal("Running not closed: a waiter would hang")
	}
	require.NoError(t, r.Close())
}

func TestCloseIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	returned := make(chan struct{})
	errc := start(t, r, context.Background(), func(ctx context.Context, draining <-chan struct{}) error {
		<-draining
		close(returned)
		return nil
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			require.NoError(t, r.Close())
			select {
			case <-returned:
			default:
				t.Error("a Close returned before the loop did")
			}
		}()
	}
	wg.Wait()
	require.NoError(t, result(t, errc))
	require.NoError(t, r.Close())
}

func TestLoopContextEndsWithRun(t *testing.T) {
	t.Parallel()
	r := runner.New("test", bound)
	var loopCtx context.Context
	require.NoError(t, r.Run(context.Background(), func(ctx context.Context, _ <-chan struct{}) error {
		loopCtx = ctx
		return nil
	}))
	require.Error(t, loopCtx.Err(), "goroutines the loop started must see its context end")
}

func TestWait(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	draining := make(chan struct{})
	require.True(t, runner.Wait(ctx, draining, 0))
	require.True(t, runner.Wait(ctx, draining, time.Millisecond))
	close(draining)
	require.False(t, runner.Wait(ctx, draining, 0))
	require.False(t, runner.Wait(ctx, draining, time.Hour))
	cancel()
	require.False(t, runner.Wait(ctx, make(chan struct{}), time.Hour))
}
