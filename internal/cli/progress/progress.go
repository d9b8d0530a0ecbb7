// Package progress is the CLI's progress reporter for long operations
// (dlq replay, clean, retry-failed, the partitioned-outbox conversion, the
// benchmarks): done/total, rate and time left, redrawn in place on a
// terminal and one plain line per interval elsewhere (CI logs), then a
// one-line summary, or on cancellation a line saying how far it got.
//
// A Reporter is driven by its operation: Set or Add after each unit of
// work; it prints only when a line is due, so calling it per row is cheap.
// It is safe for concurrent use (a benchmark's workers, a notice handler).
package progress

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// Defaults of Config.
const (
	// DefaultInterval is how often a plain (non-terminal) line is printed
	// at most, unless a tenth of the total has been done since the last.
	DefaultInterval = 5 * time.Second
	// DefaultRedraw is how often a terminal's line is redrawn at most.
	DefaultRedraw = 200 * time.Millisecond
)

// Config configures a Reporter. Out and What are required.
type Config struct {
	// Out receives the progress lines (the CLI passes stderr, so stdout
	// keeps the command's own output).
	Out io.Writer
	// What names the operation at the start of every line ("dlq replay").
	What string
	// Unit names what is counted ("messages", "rows"). Default "".
	Unit string
	// Total is the number of units the operation will do; 0 or less means
	// unknown (lines then show no percentage and no time left). SetTotal
	// changes it later.
	Total int64
	// Terminal redraws one line in place (carriage return) instead of
	// printing a line per interval. The CLI sets it when Out is a terminal.
	Terminal bool
	// Interval between plain lines. Default DefaultInterval; a line is
	// also printed each time another tenth of Total is done.
	Interval time.Duration
	// Redraw is the shortest time between two redraws on a terminal.
	// Default DefaultRedraw.
	Redraw time.Duration
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Reporter reports the progress of one operation.
type Reporter struct {
	mu       sync.Mutex
	cfg      Config
	start    time.Time
	done     int64
	lastAt   time.Time // when the last line was printed
	lastTen  int64     // tenths of Total done at the last line
	drawn    bool      // a terminal line is on screen, not yet ended
	finished bool
}

// New starts reporting: the operation's clock starts now.
func New(cfg Config) *Reporter {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.Redraw <= 0 {
		cfg.Redraw = DefaultRedraw
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	now := cfg.Now()
	return &Reporter{cfg: cfg, start: now, lastAt: now}
}

// SetTotal changes the total (when it is learnt after the start).
func (r *Reporter) SetTotal(total int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cfg.Total = total
}

// Add counts n more units done and prints a line if one is due.
func (r *Reporter) Add(n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.setLocked(r.done + n)
}

// Set records that done units are done and prints a line if one is due.
func (r *Reporter) Set(done int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.setLocked(done)
}

// Done returns the units done so far.
func (r *Reporter) Done() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done
}

func (r *Reporter) setLocked(done int64) {
	if r.finished {
		return
	}
	r.done = done
	now := r.cfg.Now()
	if r.cfg.Terminal {
		if now.Sub(r.lastAt) >= r.cfg.Redraw || !r.drawn {
			r.lastAt = now
			fmt.Fprintf(r.cfg.Out, "\r%s\x1b[K", r.line(now))
			r.drawn = true
		}
		return
	}
	ten := int64(-1)
	if r.cfg.Total > 0 {
		ten = min(done, r.cfg.Total) * 10 / r.cfg.Total
	}
	if now.Sub(r.lastAt) >= r.cfg.Interval || ten > r.lastTen {
		r.lastAt = now
		r.lastTen = max(ten, r.lastTen)
		fmt.Fprintln(r.cfg.Out, r.line(now))
	}
}

// line is "what: done/total unit (pct%), rate unit/s, about d left".
func (r *Reporter) line(now time.Time) string {
	elapsed := now.Sub(r.start)
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s", r.cfg.What, r.count())
	if rate := r.rate(elapsed); rate > 0 {
		fmt.Fprintf(&b, ", %s/s", formatRate(rate))
		if r.cfg.Total > r.done {
			left := time.Duration(float64(r.cfg.Total-r.done) / rate * float64(time.Second))
			fmt.Fprintf(&b, ", about %s left", roundDuration(left))
		}
	}
	fmt.Fprintf(&b, " (%s elapsed)", roundDuration(elapsed))
	return b.String()
}

// count is "done/total unit (pct%)", or "done unit" when the total is unknown.
func (r *Reporter) count() string {
	unit := ""
	if r.cfg.Unit != "" {
		unit = " " + r.cfg.Unit
	}
	if r.cfg.Total <= 0 {
		return fmt.Sprintf("%d%s", r.done, unit)
	}
	return fmt.Sprintf("%d/%d%s (%d%%)", r.done, r.cfg.Total, unit, r.done*100/r.cfg.Total)
}

func (r *Reporter) rate(elapsed time.Duration) float64 {
	if elapsed <= 0 || r.done <= 0 {
		return 0
	}
	return float64(r.done) / elapsed.Seconds()
}

// Wrap returns a writer to w for the operation's other output while the
// report runs: on a terminal each write first clears the progress line
// (which the next update redraws), so that the two do not run together
// on one line; off a terminal it is w.
func (r *Reporter) Wrap(w io.Writer) io.Writer {
	if !r.cfg.Terminal {
		return w
	}
	return clearing{r: r, w: w}
}

type clearing struct {
	r *Reporter
	w io.Writer
}

func (c clearing) Write(p []byte) (int, error) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if c.r.drawn {
		fmt.Fprint(c.r.cfg.Out, "\r\x1b[K")
		c.r.drawn = false
	}
	return c.w.Write(p)
}

// endLocked ends a terminal line in progress, so the next line starts on
// its own.
func (r *Reporter) endLocked() {
	if r.drawn {
		fmt.Fprintln(r.cfg.Out)
		r.drawn = false
	}
	r.finished = true
}

// Finish prints the one-line summary of a completed operation:
// "what: done/total unit in 12s (40/s)", then detail if not empty.
// Later calls of the Reporter print nothing.
func (r *Reporter) Finish(detail string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return
	}
	now := r.cfg.Now()
	r.endLocked()
	elapsed := now.Sub(r.start)
	line := fmt.Sprintf("%s: done, %s in %s", r.cfg.What, r.count(), roundDuration(elapsed))
	if rate := r.rate(elapsed); rate > 0 {
		line += fmt.Sprintf(" (%s/s)", formatRate(rate))
	}
	if detail != "" {
		line += "; " + detail
	}
	fmt.Fprintln(r.cfg.Out, line)
}

// Stopped prints how far an operation that did not complete (cancelled,
// or failed) got, with why, and resume: what re-running it does (say it
// only where it is true), e.g. "re-running continues safely: replayed rows
// are skipped". Later calls of the Reporter print nothing.
func (r *Reporter) Stopped(why error, resume string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return
	}
	now := r.cfg.Now()
	r.endLocked()
	line := fmt.Sprintf("%s: stopped at %s after %s", r.cfg.What, r.count(), roundDuration(now.Sub(r.start)))
	if why != nil {
		line += ": " + firstLine(why.Error())
	}
	if resume != "" {
		line += "; " + resume
	}
	fmt.Fprintln(r.cfg.Out, line)
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

func formatRate(r float64) string {
	switch {
	case r >= 100:
		return fmt.Sprintf("%.0f", r)
	case r >= 10:
		return fmt.Sprintf("%.1f", r)
	default:
		return fmt.Sprintf("%.2f", r)
	}
}

// roundDuration keeps a duration readable: whole seconds above 10s,
// tenths below, milliseconds below a second.
func roundDuration(d time.Duration) time.Duration {
	switch {
	case d >= 10*time.Second:
		return d.Round(time.Second)
	case d >= time.Second:
		return d.Round(100 * time.Millisecond)
	default:
		return d.Round(time.Millisecond)
	}
}
