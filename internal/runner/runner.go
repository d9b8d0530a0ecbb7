package runner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrRunTwice is wrapped by the error Run returns when it was already
// called on the same Runner.
var ErrRunTwice = errors.New("Run called twice")

// Loop is a component's main loop. It runs until ctx is done (return
// promptly, abandoning the round in flight) or draining is closed (finish
// the current round, then return). Its error is Run's.
type Loop func(ctx context.Context, draining <-chan struct{}) error

// Runner runs one Loop once. Create it with New; the zero value is not
// usable.
type Runner struct {
	name         string
	closeTimeout time.Duration

	mu       sync.Mutex
	started  bool
	closed   bool
	cancel   context.CancelFunc
	canceled bool // cancelled by Close after the timeout

	running  chan struct{}
	draining chan struct{}
	done     chan struct{}
}

// New returns a runner for the component called name (used in errors, e.g.
// "outbox.Relay") whose Close waits up to closeTimeout for the loop to
// drain before cancelling it. closeTimeout <= 0 cancels at once.
func New(name string, closeTimeout time.Duration) *Runner {
	return &Runner{
		name:         name,
		closeTimeout: closeTimeout,
		running:      make(chan struct{}),
		draining:     make(chan struct{}),
		done:         make(chan struct{}),
	}
}

// Run calls loop and blocks until it returns. The loop's context is a child
// of ctx, cancelled when Run returns (so goroutines the loop started end
// with it) or when Close gives up waiting for the drain. An error the loop
// returns because Close cancelled it (context.Canceled) is not an error:
// Run returns nil then.
func (r *Runner) Run(ctx context.Context, loop Loop) error {
	r.mu.Lock()
	if r.closed {
		if !r.started {
			r.started = true
			close(r.running)
			close(r.done)
		}
		r.mu.Unlock()
		return nil
	}
	if r.started {
		r.mu.Unlock()
		return fmt.Errorf("%s: %w: create one %s per Run", r.name, ErrRunTwice, r.name)
	}
	r.started = true
	ctx, cancel := context.WithCancel(ctx)
	r.cancel = cancel
	r.mu.Unlock()
	defer close(r.done)
	defer cancel()

	close(r.running)
	err := loop(ctx, r.draining)
	r.mu.Lock()
	canceled := r.canceled
	r.mu.Unlock()
	if canceled && errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// Running is closed once Run has started the loop (or returned at once
// because Close came first).
func (r *Runner) Running() <-chan struct{} { return r.running }

// Draining is closed when Close is called: the loop passed to Run receives
// the same channel. Code the loop calls (a component's RunOnce) checks it
// between batches to stop early.
func (r *Runner) Draining() <-chan struct{} { return r.draining }

// Done is closed once Run has returned (or will never run the loop).
func (r *Runner) Done() <-chan struct{} { return r.done }

// Close asks the loop to drain, waits up to the close timeout for it to
// return, then cancels its context and waits for it. It is idempotent and
// returns nil; before Run it only makes a later Run return at once.
func (r *Runner) Close() error {
	r.mu.Lock()
	if !r.closed {
		r.closed = true
		close(r.draining)
	}
	started := r.started
	r.mu.Unlock()
	if !started {
		return nil
	}
	if r.closeTimeout > 0 {
		t := time.NewTimer(r.closeTimeout)
		defer t.Stop()
		select {
		case <-r.done:
			return nil
		case <-t.C:
		}
	}
	r.mu.Lock()
	if r.cancel != nil {
		r.canceled = true
		r.cancel()
	}
	r.mu.Unlock()
	<-r.done
	return nil
}

// Wait pauses a loop for d: it returns true when d has passed, false when
// ctx is done or draining is closed first (the loop should return). d <= 0
// returns at once (true unless the loop should stop).
func Wait(ctx context.Context, draining <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		select {
		case <-ctx.Done():
			return false
		case <-draining:
			return false
		default:
			return true
		}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-draining:
		return false
	case <-t.C:
		return true
	}
}
