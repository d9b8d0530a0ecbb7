package progress_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/cli/progress"
)

// clock is a fake clock the test advances.
type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func setup() (*clock, *bytes.Buffer) {
	return &clock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}, &bytes.Buffer{}
}

func lines(b *bytes.Buffer) []string {
	return strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
}

// Off a terminal: one plain line per interval (5 s by default) whatever
// the number of updates, and one each time another tenth is done; then
// the summary.
func TestPlainLinesPerIntervalAndSummary(t *testing.T) {
	t.Parallel()
	c, out := setup()
	r := progress.New(progress.Config{Out: out, What: "dlq replay", Unit: "messages", Total: 1000, Now: c.now})

	// 40 updates of 1 message every 250 ms: 10 s, 40 messages (4%, no tenth).
	for range 40 {
		c.advance(250 * time.Millisecond)
		r.Add(1)
	}
	require.Equal(t, []string{
		"dlq replay: 20/1000 messages (2%), 4.00/s, about 4m5s left (5s elapsed)",
		"dlq replay: 40/1000 messages (4%), 4.00/s, about 4m0s left (10s elapsed)",
	}, lines(out), "a line every 5 s")

	// A burst to 100 and 250 crosses the 10% and 20% marks: a line each.
	out.Reset()
	c.advance(time.Second)
	r.Set(100)
	c.advance(time.Second)
	r.Set(250)
	r.Set(251) // same tenth, same instant: no line
	require.Equal(t, []string{
		"dlq replay: 100/1000 messages (10%), 9.09/s, about 1m39s left (11s elapsed)",
		"dlq replay: 250/1000 messages (25%), 20.8/s, about 36s left (12s elapsed)",
	}, lines(out))

	out.Reset()
	c.advance(3 * time.Second)
	r.Set(1000)
	r.Finish("skipped 3 already replayed")
	r.Add(5) // after Finish: nothing
	require.Equal(t, []string{
		"dlq replay: 1000/1000 messages (100%), 66.7/s (15s elapsed)",
		"dlq replay: done, 1000/1000 messages (100%) in 15s (66.7/s); skipped 3 already replayed",
	}, lines(out))
}

// A cancelled operation says how far it got, why, and what re-running does.
func TestStoppedSaysHowFar(t *testing.T) {
	t.Parallel()
	c, out := setup()
	r := progress.New(progress.Config{Out: out, What: "clean", Unit: "rows", Total: 400, Interval: time.Hour, Now: c.now})
	c.advance(2 * time.Second)
	r.Set(30) // below a tenth, within the interval: no line
	require.Empty(t, out.String())
	r.Stopped(context.Canceled, "re-running continues safely: deleted rows stay deleted")
	r.Finish("") // after Stopped: nothing
	require.Equal(t, "clean: stopped at 30/400 rows (7%) after 2s: context canceled; re-running continues safely: deleted rows stay deleted\n", out.String())
}

// With the total unknown a line shows the count and the rate only.
func TestUnknownTotal(t *testing.T) {
	t.Parallel()
	c, out := setup()
	r := progress.New(progress.Config{Out: out, What: "bench", Now: c.now})
	c.advance(5 * time.Second)
	r.Set(10)
	r.Finish("")
	require.Equal(t, []string{"bench: 10, 2.00/s (5s elapsed)", "bench: done, 10 in 5s (2.00/s)"}, lines(out))
}

// On a terminal the line is redrawn in place, at most once per Redraw,
// and ended before the summary.
func TestTerminalRedrawsInPlace(t *testing.T) {
	t.Parallel()
	c, out := setup()
	r := progress.New(progress.Config{Out: out, What: "w", Total: 10, Terminal: true, Now: c.now})
	c.advance(time.Second)
	r.Set(1)
	r.Set(2) // within Redraw of the first: not drawn
	c.advance(time.Second)
	r.Set(5)
	r.Finish("")
	require.Equal(t, "\rw: 1/10 (10%), 1.00/s, about 9s left (1s elapsed)\x1b[K"+
		"\rw: 5/10 (50%), 2.50/s, about 2s left (2s elapsed)\x1b[K\n"+
		"w: done, 5/10 (50%) in 2s (2.50/s)\n", out.String())
}

// On a terminal, other output written through Wrap clears the progress
// line first; the next update draws it again at once.
func TestWrapClearsTheTerminalLine(t *testing.T) {
	t.Parallel()
	c, out := setup()
	r := progress.New(progress.Config{Out: out, What: "w", Total: 4, Terminal: true, Now: c.now})
	other := r.Wrap(out)
	c.advance(time.Second)
	r.Set(1)
	_, _ = other.Write([]byte("deleted 1 row\n"))
	r.Set(2) // within Redraw, but the line was cleared: drawn again
	require.Equal(t, "\rw: 1/4 (25%), 1.00/s, about 3s left (1s elapsed)\x1b[K"+
		"\r\x1b[Kdeleted 1 row\n"+
		"\rw: 2/4 (50%), 2.00/s, about 1s left (1s elapsed)\x1b[K", out.String())

	var plain bytes.Buffer
	p := progress.New(progress.Config{Out: &plain, What: "w"})
	require.Same(t, &plain, p.Wrap(&plain).(*bytes.Buffer), "off a terminal Wrap is the writer itself")
}
