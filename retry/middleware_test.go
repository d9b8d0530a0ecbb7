package retry_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/retry"
)

// fast is a policy whose delays are a few milliseconds, so that tests that
// go through real backoffs stay quick.
var fast = retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxAttempts: 4}

func newMiddleware(t *testing.T, cfg retry.Config) *retry.Middleware {
	t.Helper()
	m, err := retry.NewMiddleware(cfg)
	require.NoError(t, err)
	return m
}

func newMsg() *message.Message {
	return message.NewMessage("uuid-1", []byte("payload"))
}

var errBoom = errors.New("boom")

func TestDelayWithinBounds(t *testing.T) {
	t.Parallel()
	base := retry.Policy{InitialInterval: 100 * time.Millisecond, MaxInterval: 2 * time.Second, Multiplier: 2}
	for _, j := range []retry.Jitter{retry.JitterFull, retry.JitterEqual, retry.JitterDecorrelated, retry.JitterNone} {
		t.Run(string(j), func(t *testing.T) {
			p := base
			p.Jitter = j
			var prev time.Duration
			for i := 0; i < 2000; i++ {
				attempt := i%8 + 1
				if attempt == 1 {
					prev = 0
				}
				b := p.Backoff(attempt)
				d := p.Delay(attempt, prev)
				switch j {
				case retry.JitterFull:
					require.True(t, d >= 0 && d <= b, "full jitter delay %s outside [0, %s]", d, b)
				case retry.JitterEqual:
					require.True(t, d >= b/2 && d <= b, "equal jitter delay %s outside [%s, %s]", d, b/2, b)
				case retry.JitterDecorrelated:
					hi := max(prev, p.InitialInterval) * 3
					hi = min(hi, p.MaxInterval)
					require.True(t, d >= p.InitialInterval && d <= hi, "decorrelated delay %s outside [%s, %s]", d, p.InitialInterval, hi)
				case retry.JitterNone:
					require.Equal(t, b, d)
				}
				require.LessOrEqual(t, d, p.MaxInterval)
				prev = d
			}
		})
	}
}

// TestDelaySpread checks that the default jitter spreads two clients that
// failed at the same moment: their delays rarely coincide, and the mean sits
// in the middle of the range. Bounds are many standard deviations wide, so
// the test cannot flake: with uniform delays over [0, b], P(|d1-d2| < b/100)
// is about 2% and the mean of 4000 draws has a standard deviation of 0.5% of b.
func TestDelaySpread(t *testing.T) {
	t.Parallel()
	p := retry.Policy{InitialInterval: 100 * time.Millisecond, MaxInterval: 10 * time.Second}.WithDefaults()
	require.Equal(t, retry.JitterFull, p.Jitter, "full jitter is the default")
	const n = 4000
	b := p.Backoff(3)
	near, sum := 0, time.Duration(0)
	for i := 0; i < n; i++ {
		d1, d2 := p.Delay(3, 0), p.Delay(3, 0)
		if (d1 - d2).Abs() < b/100 {
			near++
		}
		sum += d1 + d2
	}
	require.Less(t, near, n/10, "two clients retried within 1%% of the backoff %d times out of %d", near, n)
	mean := sum / (2 * n)
	require.InDelta(t, float64(b/2), float64(mean), float64(b/10), "mean delay %s, want about %s", mean, b/2)
}

// TestMiddlewareMessagesDoNotRetryInLockstep runs two messages that fail
// together and checks their retry delays differ.
func TestMiddlewareMessagesDoNotRetryInLockstep(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	delays := map[string][]time.Duration{}
	m := newMiddleware(t, retry.Config{
		Policy: fast,
		OnRetry: func(msg *message.Message, _ int, _ error, d time.Duration) {
			mu.Lock()
			delays[msg.UUID] = append(delays[msg.UUID], d)
			mu.Unlock()
		},
	})
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errBoom })
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, id := range []string{"a", "b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := h(message.NewMessage(id, nil))
			errs <- err
		}()
	}
	wg.Wait()
	require.ErrorIs(t, <-errs, errBoom)
	require.ErrorIs(t, <-errs, errBoom)
	require.Len(t, delays["a"], fast.MaxAttempts-1)
	require.Len(t, delays["b"], fast.MaxAttempts-1)
	require.NotEqual(t, delays["a"], delays["b"], "both messages waited the same delays")
}

func TestMiddlewareExhaustsAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	calls := 0
	m := newMiddleware(t, retry.Config{Policy: fast})
	_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, errBoom
	})(newMsg())
	require.ErrorIs(t, err, errBoom)
	require.Equal(t, fast.MaxAttempts, calls)
	var re *retry.Error
	require.ErrorAs(t, err, &re)
	require.Equal(t, fast.MaxAttempts, re.Attempts)
	require.False(t, re.Interrupted)
	require.False(t, re.FirstFailure.IsZero())
	require.False(t, re.LastFailure.Before(re.FirstFailure))
	require.True(t, retry.Final(err))
}

func TestMiddlewareSucceedsAfterRetries(t *testing.T) {
	t.Parallel()
	var seen []int
	m := newMiddleware(t, retry.Config{Policy: fast})
	out := message.NewMessage("out", nil)
	produced, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		n := retry.Attempt(msg.Context())
		seen = append(seen, n)
		if n < 3 {
			return nil, errBoom
		}
		return []*message.Message{out}, nil
	})(newMsg())
	require.NoError(t, err)
	require.Equal(t, []*message.Message{out}, produced)
	require.Equal(t, []int{1, 2, 3}, seen, "attempt numbers seen by the handler")
}

func TestMiddlewarePermanentStopsAtOnce(t *testing.T) {
	t.Parallel()
	calls := 0
	m := newMiddleware(t, retry.Config{Policy: retry.Policy{InitialInterval: time.Hour, MaxInterval: time.Hour}})
	_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, failure.Permanent(errBoom)
	})(newMsg())
	require.Equal(t, 1, calls)
	require.True(t, failure.IsPermanent(err))
	require.ErrorIs(t, err, errBoom)
	var re *retry.Error
	require.ErrorAs(t, err, &re)
	require.Equal(t, 1, re.Attempts)
	require.True(t, retry.Final(err))
}

func panicker() { panic("kaboom") }

func TestMiddlewareRecoversPanicWithStack(t *testing.T) {
	t.Parallel()
	m := newMiddleware(t, retry.Config{Policy: fast})
	calls := 0
	_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		calls++
		panicker()
		return nil, nil
	})(newMsg())
	require.Equal(t, fast.MaxAttempts, calls, "a panic is retried like an error")
	var pe *retry.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "kaboom", pe.Value)
	require.Contains(t, pe.Stack(), "retry_test.panicker", "stack names the panicking function")
	require.NotContains(t, pe.Stack(), "runtime/debug.Stack", "recovery frames are trimmed")
	require.True(t, strings.HasPrefix(pe.Stack(), "goroutine "), pe.Stack())
	lines := strings.SplitN(pe.Stack(), "\n", 3)
	require.Contains(t, lines[1], "retry_test.panicker", "the first frame is the panicking function")
	require.Equal(t, "panic: kaboom", pe.Error())

	// panic(err) is visible to errors.Is.
	_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) {
		panic(failure.Permanent(errBoom))
	})(newMsg())
	require.ErrorIs(t, err, errBoom)
	require.True(t, failure.IsPermanent(err))
}

func TestMiddlewareShutdownDuringBackoffReturnsPromptly(t *testing.T) {
	t.Parallel()
	m := newMiddleware(t, retry.Config{Policy: retry.Policy{InitialInterval: time.Hour, MaxInterval: time.Hour, Jitter: retry.JitterNone}})
	ctx, cancel := context.WithCancel(context.Background())
	msg := newMsg()
	msg.SetContext(ctx)
	failed := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
			close(failed)
			return nil, errBoom
		})(msg)
		done <- err
	}()
	select {
	case <-failed:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not run within 10s")
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		// The backoff is an hour: a minute separates "returned on the
		// cancel" from "waited it out" on any machine (5 s measured load).
		require.Less(t, time.Since(start), time.Minute)
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorIs(t, err, errBoom)
		var re *retry.Error
		require.ErrorAs(t, err, &re)
		require.True(t, re.Interrupted)
		require.False(t, retry.Final(err), "an interrupted retry must be redelivered, not dead-lettered")
	case <-time.After(time.Minute):
		t.Fatal("middleware still waiting out an hour-long backoff a minute after its context was cancelled")
	}
}

type ctxKey struct{}

func TestMiddlewareRestoresContextOnEachAttempt(t *testing.T) {
	t.Parallel()
	m := newMiddleware(t, retry.Config{Policy: fast})
	orig := context.WithValue(context.Background(), ctxKey{}, "original")
	msg := newMsg()
	msg.SetContext(orig)
	attempt := 0
	_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		attempt++
		ctx := msg.Context()
		require.NoError(t, ctx.Err(), "attempt %d got a cancelled context", attempt)
		require.Equal(t, "original", ctx.Value(ctxKey{}), "attempt %d lost the original context", attempt)
		if attempt == 1 {
			// Replace the context with a cancelled one, as a handler with
			// a timeout would (Watermill issue #467).
			c, cancel := context.WithCancel(context.WithValue(ctx, ctxKey{}, "replaced"))
			cancel()
			msg.SetContext(c)
			return nil, errBoom
		}
		return nil, nil
	})(msg)
	require.NoError(t, err)
	require.Equal(t, 2, attempt)
	require.Equal(t, orig, msg.Context(), "the message's context is restored after the middleware")
}

func TestMiddlewareCountsRetries(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	m := newMiddleware(t, retry.Config{Policy: fast, Registerer: reg})
	// A second middleware on the same registry shares the counter.
	_ = newMiddleware(t, retry.Config{Policy: fast, Registerer: reg})
	_, _ = m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errBoom })(newMsg())
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.Len(t, mfs, 1)
	require.Equal(t, retry.MetricRetries, mfs[0].GetName())
	require.Len(t, mfs[0].GetMetric(), 1, "one series: topic \"\", reason error")
	require.Equal(t, float64(fast.MaxAttempts-1), mfs[0].GetMetric()[0].GetCounter().GetValue())
}

func TestNewMiddlewareRejectsInvalidPolicy(t *testing.T) {
	t.Parallel()
	_, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{Multiplier: 0.5}})
	require.ErrorContains(t, err, "Multiplier")
}

func TestDo(t *testing.T) {
	t.Parallel()
	calls := 0
	err := retry.Do(context.Background(), fast, func(ctx context.Context) error {
		calls++
		require.Equal(t, calls, retry.Attempt(ctx))
		if calls < 2 {
			return errBoom
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 2, calls)

	err = retry.Do(context.Background(), fast, func(context.Context) error { return failure.Permanent(errBoom) })
	require.True(t, failure.IsPermanent(err))

	err = retry.Do(context.Background(), retry.Policy{Jitter: "random"}, func(context.Context) error { return nil })
	require.ErrorContains(t, err, "Jitter")
}

func TestMiddlewareSkipsMessageWhoseContextEnded(t *testing.T) {
	t.Parallel()
	m := newMiddleware(t, retry.Config{Policy: fast})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := newMsg()
	msg.SetContext(ctx)
	calls := 0
	_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, nil
	})(msg)
	require.Equal(t, 0, calls)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, retry.Final(err))
}
