package health

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Checker reports whether one thing the process needs is ready: nil when it
// is, an error saying what is wrong otherwise. Check must be safe for
// concurrent use and return when ctx ends.
type Checker interface {
	Check(ctx context.Context) error
}

// CheckerFunc adapts a function to Checker.
type CheckerFunc func(ctx context.Context) error

// Check calls f.
func (f CheckerFunc) Check(ctx context.Context) error { return f(ctx) }

var _ Checker = CheckerFunc(nil)

// ErrDraining is the readiness error of a Handler after Drain.
var ErrDraining = errors.New("draining: the process is shutting down")

// Config configures a Handler. The zero value is valid.
type Config struct {
	// CheckTimeout bounds each check of a readiness request; a check still
	// running then fails with "did not answer within". Default
	// DefaultCheckTimeout; minimum 1ms. Keep it below the probe's
	// timeoutSeconds.
	CheckTimeout time.Duration
	// CacheFor is how long a readiness evaluation's results answer later
	// requests: within it, requests run no check. Default 0: every
	// request after the last evaluation ended runs the checks again.
	// Either way, requests that arrive while an evaluation runs share it
	// instead of starting their own, so a flood of requests runs each
	// check at most once at a time (a database check takes one
	// connection, not one per request). Draining (Drain) shows at once,
	// whatever CacheFor. Negative is invalid.
	CacheFor time.Duration
}

// DefaultCheckTimeout is Config.CheckTimeout's default.
const DefaultCheckTimeout = 2 * time.Second

func (c *Config) setDefaults() {
	if c.CheckTimeout == 0 {
		c.CheckTimeout = DefaultCheckTimeout
	}
}

// Validate reports an invalid field, naming it.
func (c Config) Validate() error {
	if c.CheckTimeout < time.Millisecond {
		return fmt.Errorf("health: Config.CheckTimeout %s: want at least 1ms", c.CheckTimeout)
	}
	if c.CacheFor < 0 {
		return fmt.Errorf("health: Config.CacheFor %s: want 0 (evaluate per request) or more", c.CacheFor)
	}
	return nil
}

// Handler serves liveness and readiness. Add checks before serving; it is
// safe for concurrent use.
type Handler struct {
	cfg      Config
	mu       sync.Mutex
	checks   map[string]Checker
	draining atomic.Bool

	evalMu   sync.Mutex
	inflight *evaluation // the evaluation running, nil when none
	last     *evaluation // the last one that ended
	gen      uint64      // counts Add calls: an evaluation begun before one is not reused after it
}

// evaluation is one run of every check, shared by the requests that
// arrive while it runs.
type evaluation struct {
	gen     uint64 // Handler.gen when it began
	done    chan struct{}
	ended   time.Time
	results []Result
}

// NewHandler returns a handler with no checks: ready until one is added.
func NewHandler(cfg Config) (*Handler, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Handler{cfg: cfg, checks: map[string]Checker{}}, nil
}

// Add registers a readiness check under name (shown in the response). A
// second check of the same name replaces the first.
func (h *Handler) Add(name string, c Checker) {
	h.mu.Lock()
	h.checks[name] = c
	h.mu.Unlock()
	h.evalMu.Lock()
	// The next request runs the new check: it neither takes the last
	// results nor joins a run that began before this Add (that run's
	// results, without the new check or with the one it replaced, are
	// not kept either: before, a run in flight across an Add became the
	// last one when it ended and was served, and cached, after the Add).
	h.gen++
	h.last, h.inflight = nil, nil
	h.evalMu.Unlock()
}

// Drain makes readiness fail from now on with ErrDraining, while liveness
// still succeeds: call it when shutdown begins, so that the orchestrator
// stops counting the process as available before its components stop.
func (h *Handler) Drain() { h.draining.Store(true) }

// Result is the outcome of one check.
type Result struct {
	Name string
	// Err is nil when the check passed.
	Err error
}

// Report is the outcome of a readiness evaluation.
type Report struct {
	// Ready is true when every check passed and the handler is not
	// draining.
	Ready bool
	// Draining is true after Drain.
	Draining bool
	// Results, sorted by name.
	Results []Result
}

// Err joins the failures of r, nil when it is ready.
func (r Report) Err() error {
	var errs []error
	if r.Draining {
		errs = append(errs, ErrDraining)
	}
	for _, res := range r.Results {
		if res.Err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", res.Name, res.Err))
		}
	}
	return errors.Join(errs...)
}

// String is the body of the readiness response.
func (r Report) String() string {
	var b strings.Builder
	for _, res := range r.Results {
		if res.Err != nil {
			fmt.Fprintf(&b, "[-]%s failed: %s\n", res.Name, oneLine(res.Err.Error()))
		} else {
			fmt.Fprintf(&b, "[+]%s ok\n", res.Name)
		}
	}
	if r.Draining {
		fmt.Fprintf(&b, "[-]%s\n", ErrDraining)
	}
	if r.Ready {
		b.WriteString("readyz check passed\n")
	} else {
		b.WriteString("readyz check failed\n")
	}
	return b.String()
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", "; ") }

// Check runs every check concurrently, each bounded by CheckTimeout, and
// reports the outcome. A call while another runs the checks waits for
// that run's results instead of starting its own, and within
// Config.CacheFor of a run's end it takes that run's results; either way
// the wait is bounded by CheckTimeout (and ends with ctx, reported as a
// failure).
func (h *Handler) Check(ctx context.Context) Report {
	h.evalMu.Lock()
	ev := h.last
	if ev == nil || h.cfg.CacheFor <= 0 || time.Since(ev.ended) >= h.cfg.CacheFor {
		if ev = h.inflight; ev == nil {
			ev = &evaluation{gen: h.gen, done: make(chan struct{})}
			h.inflight = ev
			// The run is not the first caller's: its ctx ending must not
			// fail the others' results. CheckTimeout bounds it.
			go func() {
				results := h.evaluate(context.WithoutCancel(ctx))
				h.evalMu.Lock()
				ev.results, ev.ended = results, time.Now()
				if h.inflight == ev {
					h.inflight = nil
				}
				if ev.gen == h.gen { // no Add since it began
					h.last = ev
				}
				h.evalMu.Unlock()
				close(ev.done)
			}()
		}
	}
	h.evalMu.Unlock()
	rep := Report{Draining: h.draining.Load()}
	select {
	case <-ev.done:
		rep.Results = slices.Clone(ev.results)
	case <-ctx.Done():
		rep.Results = []Result{{Name: "readiness", Err: fmt.Errorf("request ended before the checks answered: %w", context.Cause(ctx))}}
	}
	rep.Ready = !rep.Draining
	for _, res := range rep.Results {
		if res.Err != nil {
			rep.Ready = false
		}
	}
	return rep
}

// evaluate runs every check concurrently, each within CheckTimeout.
func (h *Handler) evaluate(ctx context.Context) []Result {
	h.mu.Lock()
	names := make([]string, 0, len(h.checks))
	for n := range h.checks {
		names = append(names, n)
	}
	sort.Strings(names)
	checks := make([]Checker, len(names))
	for i, n := range names {
		checks[i] = h.checks[n]
	}
	h.mu.Unlock()

	results := make([]Result, len(names))
	var wg sync.WaitGroup
	for i := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = Result{Name: names[i], Err: h.run(ctx, checks[i])}
		}()
	}
	wg.Wait()
	return results
}

// run runs one check within CheckTimeout. A check that ignores its ctx is
// abandoned (its goroutine finishes on its own) and reported as failed.
func (h *Handler) run(ctx context.Context, c Checker) (err error) {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.CheckTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- fmt.Errorf("check panicked: %v", p)
			}
		}()
		done <- c.Check(ctx)
	}()
	select {
	case err := <-done:
		if err != nil && ctx.Err() != nil && errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("did not answer within %s: %w", h.cfg.CheckTimeout, err)
		}
		return err
	case <-ctx.Done():
		return fmt.Errorf("did not answer within %s", h.cfg.CheckTimeout)
	}
}

// Live is the liveness handler: 200 "ok" while the process serves HTTP.
// It checks nothing else (see the package doc).
func (h *Handler) Live() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		_, _ = w.Write([]byte("ok\n"))
	})
}

// Ready is the readiness handler: 200 when Check reports ready, 503
// otherwise, with Report.String as the body.
func (h *Handler) Ready() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rep := h.Check(r.Context())
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if !rep.Ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = w.Write([]byte(rep.String()))
	})
}

// Paths the handler serves under ServeHTTP, and that `millwright relay`
// and deploy/kubernetes use.
const (
	PathLive  = "/healthz"
	PathReady = "/readyz"
)

// ServeHTTP serves Live at PathLive and Ready at PathReady, 404 elsewhere,
// so that a Handler can be mounted as it is.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case PathLive:
		h.Live().ServeHTTP(w, r)
	case PathReady:
		h.Ready().ServeHTTP(w, r)
	default:
		http.NotFound(w, r)
	}
}

var _ http.Handler = (*Handler)(nil)
