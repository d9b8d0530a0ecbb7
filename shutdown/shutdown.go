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

// Grace is how long a command (Context) may take to return after the
// signal before it is made to exit. Below 1s, so that every command stops
// within a second. A service uses Service and its longer grace.
const Grace = 750 * time.Millisecond

// DefaultServiceGrace is Service's grace when none is configured: how
// long a service's in-flight handlers may take to finish after SIGTERM.
// It fits a Kubernetes pod's default terminationGracePeriodSeconds (30 s)
// with 5 s to spare (the kubelet's SIGKILL comes at 30 s). Set a Watermill
// Router's CloseTimeout (Watermill's default: 30 s) below the grace, so
// that the router gives up on a stuck handler, and says so, before the
// process is made to exit.
const DefaultServiceGrace = 25 * time.Second

// GraceEnv is the environment variable that sets Service's grace when
// Config.Grace is 0: a Go duration ("25s", "2m"). Raise it with the pod's
// terminationGracePeriodSeconds, keeping it a few seconds below.
const GraceEnv = "MILLWRIGHT_SHUTDOWN_GRACE"

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
	return watch(parent, name, func() time.Duration { return Grace + time.Duration(extraGrace.Load()) })
}

// Config configures Service.
type Config struct {
	// Name prefixes the message printed if the process is made to exit
	// ("orders").
	Name string
	// Grace is how long the service may take to return after the
	// signal: its handlers in flight finish meanwhile. Default: $GraceEnv
	// when set, else DefaultServiceGrace (25 s). Valid: above 0, at most
	// an hour. ExtendGrace does not apply.
	Grace time.Duration
}

// Service returns a context cancelled by SIGINT or SIGTERM, for a
// long-running service's main, and a stop function to defer. It is
// Context with a grace that fits an orchestrator's (Config.Grace, 25 s by
// default, inside Kubernetes' 30 s): on the signal the service stops
// taking work and lets its handlers in flight finish (a Watermill Router
// waits for them up to its CloseTimeout when ctx ends), then returns
// from main and exits 0; only a service still running Grace after the
// signal is made to exit, with status 1, printing what it still waited
// for (the handlers in flight that Middleware tracks, and the Postgres
// calls in flight). An invalid Grace or $GraceEnv is an error naming it.
func Service(parent context.Context, cfg Config) (context.Context, context.CancelFunc, error) {
	grace, err := cfg.grace(os.LookupEnv)
	if err != nil {
		return nil, nil, err
	}
	ctx, stop := watch(parent, cfg.Name, func() time.Duration { return grace })
	return ctx, stop, nil
}

// maxGrace bounds Config.Grace and $GraceEnv: a typo ("25m" for "25s")
// must not hold a stopped pod for hours.
const maxGrace = time.Hour

// grace returns the grace cfg configures (lookup reads the environment).
func (c Config) grace(lookup func(string) (string, bool)) (time.Duration, error) {
	g, src := c.Grace, "shutdown: Config.Grace"
	if g == 0 {
		v, ok := lookup(GraceEnv)
		if !ok || strings.TrimSpace(v) == "" {
			return DefaultServiceGrace, nil
		}
		var err error
		if g, err = time.ParseDuration(strings.TrimSpace(v)); err != nil {
			return 0, fmt.Errorf("shutdown: %s=%q: want a duration such as 25s (default %s): %w", GraceEnv, v, DefaultServiceGrace, err)
		}
		src = "shutdown: " + GraceEnv
	}
	if g <= 0 || g > maxGrace {
		return 0, fmt.Errorf("%s %s: want above 0 and at most %s (default %s, inside Kubernetes' 30 s terminationGracePeriodSeconds)", src, g, maxGrace, DefaultServiceGrace)
	}
	return g, nil
}

// watch is Context with the grace grace returns at the signal.
func watch(parent context.Context, name string, grace func() time.Duration) (context.Context, context.CancelFunc) {
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
		t := time.NewTimer(grace())
		defer t.Stop()
		select {
		case <-returned:
		case <-t.C:
			fmt.Fprintln(stderr, Message(name, context.Cause(ctx), time.Since(at), append(inFlight(), pgconn.Waiting()...)))
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
