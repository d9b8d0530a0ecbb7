package health

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrWaiting is wrapped by a Waiter's readiness error until its Done.
var ErrWaiting = errors.New("waiting")

// Waiter is the readiness check of something a process waits for while it
// starts, such as the broker while transport.Open waits for it
// (transport.Config.OnWait = w.Failed): it fails with "waiting for <what>"
// and the last failure until Done, and passes from then on. Readiness
// then tells an operator why the process is not ready yet, instead of
// the process exiting and restarting. It is safe for concurrent use.
type Waiter struct {
	what  string
	since time.Time

	mu       sync.Mutex
	done     bool
	failures int
	last     error
}

// Waiting returns a Waiter for what ("the broker"), waiting from now.
func Waiting(what string) *Waiter { return &Waiter{what: what, since: time.Now()} }

// Failed records a failed attempt to reach what the process waits for.
func (w *Waiter) Failed(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.failures++
	w.last = err
}

// Done ends the wait: Check passes from now on.
func (w *Waiter) Done() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done = true
}

// Check fails, wrapping ErrWaiting, until Done.
func (w *Waiter) Check(context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return nil
	}
	waited := time.Since(w.since).Round(time.Second)
	if w.last == nil {
		return fmt.Errorf("%w for %s (%s so far)", ErrWaiting, w.what, waited)
	}
	return fmt.Errorf("%w for %s (%s so far, %d failed attempts; last: %v)", ErrWaiting, w.what, waited, w.failures, w.last)
}

var _ Checker = (*Waiter)(nil)
