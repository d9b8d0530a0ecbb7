package shutdown

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/millwright/millwright/internal/deadline"
	"github.com/millwright/millwright/internal/pgconn"
)

// Grace is how long a program may take to return after the signal before
// it is made to exit. Below 1s, so that every command stops within a second.
const Grace = 750 * time.Millisecond

// extraGrace, set by ExtendGrace, is added to Grace: a program that drains
// on the signal (millwright relay) needs longer than a second.
var extraGrace atomic.Int64

// ExtendGrace lets the program take Grace+d to return after the signal,
// for a program whose drain is bounded by d (an outbox relay's
// Config.DrainTimeout, for instance). Call it before the signal; d < 0
// counts as 0. It applies to every Context of the process.
func ExtendGrace(d time.Duration) { extraGrace.Store(int64(max(d, 0))) }

// exit and stderr are replaced by tests.
var (
	exit             = os.Exit
	stderr io.Writer = os.Stderr
)

// Context returns a context cancelled by SIGINT or SIGTERM (context.Cause
// names the signal) and a stop function to defer: once stop is called the
// signals are no longer caught and nothing is forced. name prefixes the
// message printed if the program has not returned Grace after the signal.
func Context(parent context.Context, name string) (context.Context, context.CancelFunc) {
	ctx, stopSignals := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	returned := make(chan struct{})
	var once sync.Once
	go func() {
		select {
		case <-returned:
			return
		case <-ctx.Done():
		}
		if parent.Err() != nil {
			return // not a signal
		}
		at := time.Now()
		t := time.NewTimer(Grace + time.Duration(extraGrace.Load()))
		defer t.Stop()
		select {
		case <-returned:
		case <-t.C:
			fmt.Fprintln(stderr, Message(name, context.Cause(ctx), time.Since(at), pgconn.Waiting()))
			exit(1)
		}
	}()
	return ctx, func() {
		once.Do(func() { close(returned) })
		stopSignals()
	}
}

// Message is what the program prints when it is made to exit: the cause
// (the signal), how long it has waited since, and what for.
func Message(name string, cause error, waited time.Duration, waiting []string) string {
	what := "work that does not watch the signal (no Postgres call in flight)"
	if len(waiting) > 0 {
		what = strings.Join(waiting, "; ")
	}
	return fmt.Sprintf("%s: %v; still waiting after %s for %s; exiting", name, cause, waited.Round(time.Millisecond), what)
}

// DeadlinePassed reports whether ctx has ended, or its deadline has
// passed. A call that compares the deadline with the clock itself (a dial
// fails with "i/o timeout" as soon as it passes) can fail on it before the
// context's own timer has ended ctx, while ctx.Err is still nil: this
// tells such a failure apart from the others (on a loaded machine, a
// give-up reported as "after 0s").
func DeadlinePassed(ctx context.Context) bool { return deadline.Passed(ctx) }
