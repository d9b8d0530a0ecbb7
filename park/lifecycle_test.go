package park_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
)

// Parker's Run, Close and Running follow the one lifecycle of the
// long-running components (internal/runner): Run once, Close idempotent
// and safe from several goroutines, Run after Close returns at once.
func TestParkerLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t, pgtest.DriverPQ)

	t.Run("Run twice", func(t *testing.T) {
		p := b.parker(t, park.Config{PollInterval: 10 * time.Millisecond})
		done := make(chan error, 1)
		go func() { done <- p.Run(context.Background()) }()
		<-p.Running()
		err := p.Run(context.Background())
		require.ErrorIs(t, err, runner.ErrRunTwice)
		require.ErrorContains(t, err, "park.Parker")
		require.NoError(t, p.Close())
		require.NoError(t, <-done, "Close stops the first Run, which returns nil")
	})

	t.Run("Close before Run", func(t *testing.T) {
		p := b.parker(t, park.Config{})
		require.NoError(t, p.Close())
		require.NoError(t, p.Close(), "Close is idempotent")
		require.NoError(t, p.Run(context.Background()), "Run after Close returns at once")
		select {
		case <-p.Running():
		default:
			t.Fatal("Running is not closed after a Run that Close preempted: a waiter would wait forever")
		}
	})

	t.Run("cancelling Run's context", func(t *testing.T) {
		p := b.parker(t, park.Config{PollInterval: 10 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		<-p.Running()
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, p.Close())
	})
}

// Close cancels the context of the round in flight at once and returns
// once its handler has returned and Run with it; the message stays parked
// for the next retrier.
func TestCloseCancelsTheRoundInFlightAndWaitsForIt(t *testing.T) {
	t.Parallel()
	b := setup(t, pgtest.DriverPQ)
	p := b.parker(t, park.Config{PollInterval: 10 * time.Millisecond, Retry: patient})
	var (
		started   = make(chan struct{})
		startOnce sync.Once
		returned  atomic.Bool
		sawCancel atomic.Bool
	)
	h := chain(t, p, "billing", func(msg *message.Message) ([]*message.Message, error) {
		if _, retried := park.Retried(msg.Context()); !retried {
			return nil, errTransient // parks it
		}
		startOnce.Do(func() { close(started) })
		<-msg.Context().Done()
		sawCancel.Store(true)
		defer returned.Store(true)
		return nil, msg.Context().Err()
	})
	deliver(t, h, msg("a1", "a"))
	require.Len(t, b.keys(t), 1, "a1 parked")

	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-started // a round runs a1's handler

	closers := make(chan error, 2)
	for range 2 {
		go func() { closers <- p.Close() }()
	}
	require.NoError(t, <-closers)
	require.True(t, sawCancel.Load(), "the handler's context was cancelled by Close")
	require.True(t, returned.Load(), "Close returned before the round's handler did")
	select {
	case err := <-done:
		require.NoError(t, err)
	default:
		t.Fatal("Close returned before Run did")
	}
	require.NoError(t, <-closers, "the second Close returns too")
	require.Len(t, b.keys(t), 1, "a1 is still parked for the next retrier")
}
