package keyed

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type msg struct {
	key    string
	seq    int // position among its key's messages
	offset int64
}

// checker records what the handlers did and counts every violation of the
// package's promises.
type checker struct {
	t           *testing.T
	mu          sync.Mutex
	lastDone    map[string]int // the key's highest finished seq
	active      map[string]bool
	finished    map[int64]bool
	running     int
	maxRunning  int
	violations  []string
	lastCommit  int64
	commits     int
	failOnce    map[int64]bool // offsets that fail their first attempts
	failedTimes map[int64]int
}

func newChecker(t *testing.T) *checker {
	return &checker{t: t, lastDone: map[string]int{}, active: map[string]bool{}, finished: map[int64]bool{},
		lastCommit: -1, failOnce: map[int64]bool{}, failedTimes: map[int64]int{}}
}

func (c *checker) violate(format string, args ...any) {
	c.violations = append(c.violations, fmt.Sprintf(format, args...))
}

func (c *checker) handle(ctx context.Context, m msg, d time.Duration) error {
	c.mu.Lock()
	if c.active[m.key] {
		c.violate("key %s: seq %d started while another of its messages runs", m.key, m.seq)
	}
	if last, ok := c.lastDone[m.key]; (ok && last != m.seq-1) || (!ok && m.seq != 0) {
		c.violate("key %s: seq %d started after seq %d finished (last %v)", m.key, m.seq, last, ok)
	}
	c.active[m.key] = true
	c.running++
	c.maxRunning = max(c.maxRunning, c.running)
	fail := c.failOnce[m.offset] && c.failedTimes[m.offset] < 2
	c.mu.Unlock()

	if d > 0 {
		time.Sleep(d) // the handler's work: a simulated duration, not synchronisation
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	c.active[m.key] = false
	c.running--
	if fail {
		c.failedTimes[m.offset]++
		return errors.New("transient")
	}
	c.lastDone[m.key] = m.seq
	c.finished[m.offset] = true
	return nil
}

// commit is Partition's commit function: every offset below next must be
// finished, and commits must grow.
func (c *checker) commit(first int64) func(int64) {
	return func(next int64) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.commits++
		if next <= c.lastCommit {
			c.violate("commit %d after commit %d", next, c.lastCommit)
		}
		for o := max(first, c.lastCommit); o < next; o++ {
			if o%3 == 2 { // the gaps the stream leaves (see stream)
				continue
			}
			if !c.finished[o] {
				c.violate("commit %d passes unfinished offset %d", next, o)
			}
		}
		c.lastCommit = next
	}
}

// stream makes n messages over keys keys, with offsets that skip every
// third number (gaps such as Kafka's transaction markers leave).
func stream(r *rand.Rand, n, keys int) []msg {
	seq := map[string]int{}
	out := make([]msg, 0, n)
	off := int64(0)
	for i := 0; i < n; i++ {
		k := fmt.Sprintf("k%d", r.Intn(keys))
		out = append(out, msg{key: k, seq: seq[k], offset: off})
		seq[k]++
		off++
		if off%3 == 2 {
			off++
		}
	}
	return out
}

// TestPartitionProperties runs random streams (random keys, durations,
// transient failures, settings) and asserts per-key order, one message of
// a key at a time, the concurrency and in-flight bounds, and that no
// commit passes an unfinished message.
func TestPartitionProperties(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewSource(seed))
	for round := 0; round < 30; round++ {
		cfg := Config{Concurrency: 1 + r.Intn(8), RetryDelay: -1}
		cfg.MaxInFlight = cfg.Concurrency + r.Intn(40)
		n, keys := 50+r.Intn(400), 1+r.Intn(60)
		msgs := stream(r, n, keys)
		t.Run(fmt.Sprintf("round%d_c%d_f%d_keys%d", round, cfg.Concurrency, cfg.MaxInFlight, keys), func(t *testing.T) {
			runProperties(t, cfg, msgs, r.Int63())
		})
	}
}

func runProperties(t *testing.T, cfg Config, msgs []msg, seed int64) {
	c := newChecker(t)
	r := rand.New(rand.NewSource(seed))
	durations := make(map[int64]time.Duration, len(msgs))
	for _, m := range msgs {
		durations[m.offset] = time.Duration(r.Intn(300)) * time.Microsecond
		if r.Intn(20) == 0 {
			c.failOnce[m.offset] = true
		}
	}
	var inFlight atomic.Int64
	var maxInFlight atomic.Int64
	p, err := NewPartition(cfg, func(ctx context.Context, m msg) error {
		err := c.handle(ctx, m, durations[m.offset])
		if err == nil {
			inFlight.Add(-1)
		}
		return err
	}, c.commit(0))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, m := range msgs {
		require.NoError(t, p.Submit(ctx, m.key, m.offset, m))
		n := inFlight.Add(1)
		if n > maxInFlight.Load() {
			maxInFlight.Store(n)
		}
	}
	last := msgs[len(msgs)-1].offset
	require.NoError(t, waitFor(ctx, func() bool { w, _ := p.Watermark(); return w == last+1 }), "every message finishes")
	next, known, finished := p.Drain(ctx)
	require.True(t, finished && known)
	require.Equal(t, last+1, next)

	c.mu.Lock()
	defer c.mu.Unlock()
	require.Empty(t, c.violations)
	require.LessOrEqual(t, c.maxRunning, cfg.Concurrency)
	// Submit returned at most MaxInFlight times ahead of the finished
	// messages (+1: the counter is bumped after Submit returns).
	require.LessOrEqual(t, maxInFlight.Load(), int64(cfg.MaxInFlight)+1)
	require.Equal(t, last+1, c.lastCommit)
	for _, m := range msgs {
		if c.failOnce[m.offset] {
			require.Equal(t, 2, c.failedTimes[m.offset], "offset %d failed twice then ran again", m.offset)
		}
	}
}

// waitFor polls cond until it holds or ctx ends (the watermark has no
// channel to wait on; the poll is bounded by ctx).
func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// TestPartitionKeysRunConcurrently: Concurrency keys must all be running
// at once (each handler waits for all of them), and one more key waits.
func TestPartitionKeysRunConcurrently(t *testing.T) {
	t.Parallel()
	const conc = 4
	var started sync.WaitGroup
	started.Add(conc)
	release := make(chan struct{})
	var running, maxRunning atomic.Int32
	p, err := NewPartition(Config{Concurrency: conc}, func(ctx context.Context, i int) error {
		n := running.Add(1)
		for m := maxRunning.Load(); n > m && !maxRunning.CompareAndSwap(m, n); m = maxRunning.Load() {
		}
		if i < conc {
			started.Done()
		}
		<-release
		running.Add(-1)
		return nil
	}, func(int64) {})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := 0; i <= conc; i++ {
		require.NoError(t, p.Submit(ctx, fmt.Sprint("key", i), int64(i), i))
	}
	waitGroup(t, ctx, &started)
	require.Equal(t, int32(conc), maxRunning.Load())
	close(release)
	require.NoError(t, waitFor(ctx, func() bool { w, _ := p.Watermark(); return w == conc+1 }))
	require.Equal(t, int32(conc), maxRunning.Load(), "never more than Concurrency at once")
}

func waitGroup(t *testing.T, ctx context.Context, wg *sync.WaitGroup) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("handlers did not all start")
	}
}

// TestPartitionBackpressure: with MaxInFlight messages unfinished, Submit
// blocks until its context ends, and goes on once one finishes.
func TestPartitionBackpressure(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	p, err := NewPartition(Config{Concurrency: 2, MaxInFlight: 3}, func(ctx context.Context, i int) error {
		<-release
		return nil
	}, func(int64) {})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := 0; i < 3; i++ {
		require.NoError(t, p.Submit(ctx, "k", int64(i), i))
	}
	short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	require.ErrorIs(t, p.Submit(short, "k", 3, 3), context.DeadlineExceeded)
	close(release)
	require.NoError(t, p.Submit(ctx, "k", 3, 3))
	require.NoError(t, waitFor(ctx, func() bool { w, _ := p.Watermark(); return w == 4 }))
}

// TestPartitionDrain: a drain past its bound cancels the running
// handlers, returns a watermark at the oldest unfinished message, and
// commits nothing afterwards; Submit then refuses.
func TestPartitionDrain(t *testing.T) {
	t.Parallel()
	var commits []int64
	var mu sync.Mutex
	p, err := NewPartition(Config{Concurrency: 2}, func(ctx context.Context, i int) error {
		if i == 1 {
			<-ctx.Done() // the slow message: ends only when cancelled
			return ctx.Err()
		}
		return nil
	}, func(n int64) { mu.Lock(); commits = append(commits, n); mu.Unlock() })
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, p.Submit(ctx, "a", 10, 0))
	require.NoError(t, p.Submit(ctx, "b", 11, 1))
	require.NoError(t, p.Submit(ctx, "c", 12, 2))
	require.NoError(t, p.Submit(ctx, "b", 13, 3)) // behind the slow one
	require.NoError(t, waitFor(ctx, func() bool { w, _ := p.Watermark(); return w == 11 }))
	bound, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	next, known, finished := p.Drain(bound)
	require.True(t, known)
	require.False(t, finished, "the slow handler did not finish within the bound")
	require.Equal(t, int64(11), next, "the watermark stays at the unfinished message")
	require.ErrorIs(t, p.Submit(ctx, "d", 14, 4), ErrStopped)
	mu.Lock()
	defer mu.Unlock()
	for _, c := range commits {
		require.LessOrEqual(t, c, int64(11))
	}
}

// TestPartitionRejectsBackwardsOffsets and bad settings.
func TestPartitionRejects(t *testing.T) {
	t.Parallel()
	_, err := NewPartition(Config{Concurrency: 4, MaxInFlight: 2}, func(context.Context, int) error { return nil }, func(int64) {})
	require.ErrorContains(t, err, "MaxInFlight 2 is below Concurrency 4")
	p, err := NewPartition(Config{}, func(context.Context, int) error { return nil }, func(int64) {})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, p.Submit(ctx, "a", 5, 0))
	require.ErrorContains(t, p.Submit(ctx, "a", 5, 0), "offset 5 is not above")
}

// TestPartitionRunsAheadOfAStuckMessage: one message that does not finish
// holds the watermark but not the partition: the other keys' messages,
// many times MaxInFlight, all run, and what the partition keeps stays
// within MaxInFlight.
func TestPartitionRunsAheadOfAStuckMessage(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	p, err := NewPartition(Config{Concurrency: 4, MaxInFlight: 8}, func(ctx context.Context, i int) error {
		if i == 0 {
			<-release
		}
		return nil
	}, func(int64) {})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 1000
	for i := 0; i < n; i++ {
		key := fmt.Sprint("k", 1+i%50)
		if i == 0 {
			key = "stuck"
		}
		require.NoError(t, p.Submit(ctx, key, int64(i), i))
	}
	require.NoError(t, waitFor(ctx, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.wm.unfinished) == 1
	}), "all but the stuck message finish")
	w, _ := p.Watermark()
	require.Equal(t, int64(0), w, "the watermark stays at the stuck message")
	close(release)
	require.NoError(t, waitFor(ctx, func() bool { w, _ := p.Watermark(); return w == n }))
}

// TestPartitionRecoversAPanic: a handler that panics on its message's
// first attempt does not end the process or the worker: the panic is
// counted and handed to OnPanic with the message, the message runs again
// in its key's place (its key's next waits for it), other keys go on, and
// the watermark reaches the end.
func TestPartitionRecoversAPanic(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var order []string
	attempts := map[string]int{}
	var panicked []string
	var committed atomic.Int64
	p, err := NewPartition(Config{Concurrency: 2, RetryDelay: time.Millisecond}, func(_ context.Context, m msg) error {
		name := fmt.Sprintf("%s:%d", m.key, m.seq)
		mu.Lock()
		attempts[name]++
		first := attempts[name] == 1
		mu.Unlock()
		if name == "a:1" && first {
			var nilMap map[string]int
			nilMap["boom"]++ // a real runtime panic: assignment to entry in nil map
		}
		mu.Lock()
		order = append(order, name)
		mu.Unlock()
		return nil
	}, func(next int64) { committed.Store(next) })
	require.NoError(t, err)
	p.OnPanic(func(m msg, perr *PanicError) {
		mu.Lock()
		defer mu.Unlock()
		panicked = append(panicked, fmt.Sprintf("%s:%d %v", m.key, m.seq, perr.Value))
		require.Contains(t, string(perr.Stack), "TestPartitionRecoversAPanic")
	})
	var off int64
	for _, m := range []msg{{"a", 0, 0}, {"b", 0, 0}, {"a", 1, 0}, {"b", 1, 0}, {"a", 2, 0}, {"b", 2, 0}} {
		require.NoError(t, p.Submit(context.Background(), m.key, off, msg{m.key, m.seq, off}))
		off++
	}
	require.Eventually(t, func() bool { return committed.Load() == off }, 30*time.Second, time.Millisecond, "the watermark reaches the end")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, int64(1), p.Panics())
	require.Len(t, panicked, 1)
	require.Contains(t, panicked[0], "a:1 assignment to entry in nil map")
	require.Equal(t, 2, attempts["a:1"], "run again after its panic")
	pos := map[string]int{}
	for i, n := range order {
		pos[n] = i
	}
	require.Len(t, order, 6)
	require.Less(t, pos["a:0"], pos["a:1"])
	require.Less(t, pos["a:1"], pos["a:2"], "a's next message waited for the one that panicked")
}

// TestPartitionDiscard: Discard drops the messages waiting (behind their
// key's running one, or for a worker) that its function picks, giving
// their slots back at once; the running message is never dropped, and a
// key left empty is forgotten.
func TestPartitionDiscard(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan string, 10)
	var committed atomic.Int64
	p, err := NewPartition(Config{Concurrency: 1, MaxInFlight: 4}, func(_ context.Context, m msg) error {
		started <- fmt.Sprintf("%s:%d", m.key, m.seq)
		if m.key == "a" && m.seq == 0 {
			<-release
		}
		return nil
	}, func(next int64) { committed.Store(next) })
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, p.Submit(ctx, "a", 0, msg{"a", 0, 0})) // runs, hangs
	require.Equal(t, "a:0", <-started)
	require.NoError(t, p.Submit(ctx, "a", 1, msg{"a", 1, 1})) // behind a:0
	require.NoError(t, p.Submit(ctx, "b", 2, msg{"b", 0, 2})) // waits for the worker
	require.NoError(t, p.Submit(ctx, "c", 3, msg{"c", 0, 3})) // waits for the worker; 4 of 4 slots
	full, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	require.ErrorIs(t, p.Submit(full, "d", 4, msg{"d", 0, 4}), context.DeadlineExceeded, "the partition is full")
	cancel()

	n := p.Discard(func(m msg) bool { return m.offset <= 2 }) // a:0 runs: kept; a:1 and b:0 dropped
	require.Equal(t, 2, n)
	require.NoError(t, p.Submit(ctx, "d", 5, msg{"d", 0, 5}), "a dropped message gave its slot back")
	require.NoError(t, p.Submit(ctx, "e", 6, msg{"e", 0, 6}))
	close(release)
	var ran []string
	for len(ran) < 3 {
		ran = append(ran, <-started)
	}
	require.ElementsMatch(t, []string{"c:0", "d:0", "e:0"}, ran, "the dropped messages never ran")
	require.Eventually(t, func() bool { return committed.Load() == 7 }, 30*time.Second, time.Millisecond, "dropped messages count as finished for the watermark")
}
