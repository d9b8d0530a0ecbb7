package retry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/internal/promreg"

	"github.com/millwright/millwright/internal/redact"
)

// Config configures the retry middleware. The zero value is usable.
type Config struct {
	// Policy decides how often and how long to retry. Zero fields take the
	// Policy defaults (5 attempts, 100ms doubling to 30s, full jitter).
	Policy Policy
	// Logger receives one line per retry (at Info) and per give-up (at
	// Error). Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Registerer registers the retry counter (MetricRetries). Default nil:
	// no metrics. Several middlewares may share one Registerer.
	Registerer prometheus.Registerer
	// SilentGiveUp suppresses the Error line logged when the middleware
	// gives up, for a caller that logs the outcome itself (the dlq
	// middleware logs one line per dead letter). Default false.
	SilentGiveUp bool
	// OnRetry, when set, is called before each backoff wait with the
	// attempt that failed (1-based), its error and the chosen delay. It runs
	// on the handler's goroutine and must not block.
	OnRetry func(msg *message.Message, attempt int, err error, delay time.Duration)
}

// MetricRetries counts retries (attempts after the first) by subscribe
// topic and reason ("error" or "panic").
const MetricRetries = "millwright_retry_retries_total"

// Retry reasons, the "reason" label of MetricRetries.
const (
	ReasonError = "error"
	ReasonPanic = "panic"
)

// Middleware retries a Watermill handler according to a Policy. Create it
// with NewMiddleware; it is safe for concurrent use by many handlers.
type Middleware struct {
	policy  Policy
	logger  watermill.LoggerAdapter
	silent  bool
	retries *prometheus.CounterVec
	onRetry func(*message.Message, int, error, time.Duration)
}

func (c *Config) setDefaults() {
	c.Policy = c.Policy.WithDefaults()
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if _, nop := c.Logger.(watermill.NopLogger); !nop {
		// Handler errors often quote a DSN or URL with its password.
		c.Logger = redact.Logger(c.Logger)
	}
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	if err := c.Policy.Validate(); err != nil {
		return fmt.Errorf("retry: invalid Config.Policy: %w", err)
	}
	return nil
}

// NewMiddleware returns a retry middleware. Use its Middleware method with
// message.Router.AddMiddleware or Handler.AddMiddleware.
//
// It recovers panics into *PanicError (with the stack), stops at once on
// failure.Permanent errors, waits jittered delays that end early when the message's
// context ends, gives every attempt the message's original context (so an
// attempt that cancelled or replaced it does not poison the next one,
// Watermill issue #467), and makes the attempt number available through
// Attempt(msg.Context()). When it gives up it returns an *Error carrying the
// attempt count and failure times; the dlq package reads them.
func NewMiddleware(cfg Config) (*Middleware, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Middleware{policy: cfg.Policy, logger: cfg.Logger, silent: cfg.SilentGiveUp, onRetry: cfg.OnRetry}
	if cfg.Registerer != nil {
		cv := prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricRetries,
			Help: "Retries of failed message handlers (attempts after the first), by subscribe topic and reason.",
		}, []string{"topic", "reason"})
		c, err := promreg.Register(cfg.Registerer, cv)
		if err != nil {
			return nil, fmt.Errorf("retry: registering metric %s: %w", MetricRetries, err)
		}
		m.retries = c
	}
	return m, nil
}

// Middleware wraps h with retries. Its shape is message.HandlerMiddleware.
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		original := msg.Context()
		// Restore the original context for the middlewares outside us, even
		// when the handler replaced it.
		defer msg.SetContext(original)

		var produced []*message.Message
		err := run(original, m.policy, func(ctx context.Context) error {
			msg.SetContext(ctx)
			var err error
			produced, err = h(msg)
			return err
		}, func(attempt int, err error, delay time.Duration) {
			m.notify(msg, original, attempt, err, delay)
		})
		if err != nil {
			var re *Error
			if errors.As(err, &re) && !re.Interrupted && !m.silent {
				m.logger.Error("Giving up on message", err, logfields.Of(message.SubscribeTopicFromCtx(original), msg).Add(watermill.LogFields{
					"handler":   message.HandlerNameFromCtx(original),
					"attempts":  re.Attempts,
					"permanent": failure.IsPermanent(err),
				}))
			}
			return nil, err
		}
		return produced, nil
	}
}

func (m *Middleware) notify(msg *message.Message, ctx context.Context, attempt int, err error, delay time.Duration) {
	topic := message.SubscribeTopicFromCtx(ctx)
	reason := ReasonError
	var pe *PanicError
	if errors.As(err, &pe) {
		reason = ReasonPanic
	}
	if m.retries != nil {
		m.retries.WithLabelValues(topic, reason).Inc()
	}
	m.logger.Info("Handler failed, retrying", logfields.Of(topic, msg).Add(watermill.LogFields{
		"attempt": attempt,
		"delay":   delay.String(),
		"error":   err.Error(),
	}))
	if m.onRetry != nil {
		m.onRetry(msg, attempt, err, delay)
	}
}

// Do calls fn until it succeeds, returns a permanent error (failure.Permanent), or the policy is
// exhausted, waiting the policy's jittered delays between attempts. Panics
// in fn are recovered into *PanicError. The ctx given to fn carries the
// attempt number (see Attempt). Do returns nil on success, or an *Error
// wrapping the last error; when ctx ends during a wait it returns at once
// with an *Error marked Interrupted that also matches ctx.Err() via
// errors.Is; it does not call fn at all when ctx has already ended. The
// zero Policy uses the defaults; an invalid policy is returned as an error
// before fn runs.
func Do(ctx context.Context, p Policy, fn func(ctx context.Context) error) error {
	p = p.WithDefaults()
	if err := p.Validate(); err != nil {
		return fmt.Errorf("retry.Do: invalid policy: %w", err)
	}
	return run(ctx, p, fn, nil)
}

type attemptKey struct{}

// Attempt returns the attempt number (1 for the first delivery, 2 for the
// first retry, ...) carried by a context given to a handler by the
// middleware or to fn by Do; 0 when ctx did not come from either.
func Attempt(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}

// run is the retry loop shared by the middleware and Do. p must have its
// defaults set.
func run(ctx context.Context, p Policy, fn func(context.Context) error, notify func(int, error, time.Duration)) error {
	var (
		first, last time.Time
		start       = time.Now()
		prevDelay   time.Duration
	)
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			// Shutting down (or the message was cancelled): do not start
			// work that cannot finish; the message is redelivered.
			return &Error{Err: err, Attempts: attempt - 1, FirstFailure: first, LastFailure: last, Interrupted: true}
		}
		err := callRecovering(context.WithValue(ctx, attemptKey{}, attempt), fn)
		if err == nil {
			return nil
		}
		last = time.Now()
		if attempt == 1 {
			first = last
		}
		fail := &Error{Err: err, Attempts: attempt, FirstFailure: first, LastFailure: last}
		if failure.IsPermanent(err) {
			return fail
		}
		if p.Exhausted(attempt, time.Since(start)) {
			// A failure while shutting down may be caused by the shutdown:
			// let the message be redelivered rather than parked.
			fail.Interrupted = ctx.Err() != nil
			return fail
		}
		delay := p.Delay(attempt, prevDelay)
		prevDelay = delay
		if p.MaxElapsedTime > 0 {
			if left := p.MaxElapsedTime - time.Since(start); delay > left && left > 0 {
				delay = left
			}
		}
		if notify != nil {
			notify(attempt, err, delay)
		}
		if err := sleep(ctx, delay); err != nil {
			fail.Interrupted = true
			fail.Err = errors.Join(fail.Err, err)
			return fail
		}
	}
}

// sleep waits d or until ctx ends, whichever is first.
func sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// callRecovering calls fn, turning a panic into a *PanicError.
func callRecovering(ctx context.Context, fn func(context.Context) error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = newPanicError(r)
		}
	}()
	return fn(ctx)
}
