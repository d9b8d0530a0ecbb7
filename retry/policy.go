package retry

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// Jitter selects how a Policy spreads its delays.
type Jitter string

const (
	// JitterFull draws each delay uniformly from [0, backoff]. It is the
	// default: of the strategies compared in the AWS architecture study
	// "Exponential Backoff and Jitter" it does the least total work and
	// spreads clients that failed together the widest, which is what stops
	// a broker outage from turning into synchronized retry waves.
	JitterFull Jitter = "full"
	// JitterEqual draws each delay from [backoff/2, backoff]: never much
	// shorter than the exponential schedule, still spread.
	JitterEqual Jitter = "equal"
	// JitterDecorrelated draws each delay from [Initial, previous*3], capped
	// at MaxInterval.
	JitterDecorrelated Jitter = "decorrelated"
	// JitterNone uses the exponential schedule as is. Only for tests and
	// single-client tools; it makes clients retry in lockstep.
	JitterNone Jitter = "none"
)

// Policy is an exponential backoff with jitter. The zero value is usable:
// setDefaults fills every unset field. Policy is a value type and is safe
// for concurrent use; per-attempt state lives in the caller.
type Policy struct {
	// InitialInterval is the base delay before the first retry. Default 100ms.
	InitialInterval time.Duration
	// Multiplier grows the base delay after each attempt. Default 2; must be >= 1.
	Multiplier float64
	// MaxInterval caps every delay. Default 30s.
	MaxInterval time.Duration
	// MaxAttempts is the total number of attempts, the first included.
	// Default 5; -1 means no limit (then MaxElapsedTime should be set).
	MaxAttempts int
	// MaxElapsedTime stops retrying once this much time has passed since the
	// first attempt: a duration budget, what an operator plans an outage
	// with. Jitter stays inside it (see Next): attempts go on until the
	// budget has passed, whatever the delays drew, and the attempt at its
	// end is the last. Default 0: no limit.
	MaxElapsedTime time.Duration
	// Jitter strategy. Default JitterFull.
	Jitter Jitter
}

// WithDefaults returns p with every unset field set to its default.
func (p Policy) WithDefaults() Policy {
	if p.InitialInterval == 0 {
		p.InitialInterval = 100 * time.Millisecond
	}
	if p.Multiplier == 0 {
		p.Multiplier = 2
	}
	if p.MaxInterval == 0 {
		p.MaxInterval = 30 * time.Second
	}
	if p.MaxAttempts == 0 {
		p.MaxAttempts = 5
	}
	if p.Jitter == "" {
		p.Jitter = JitterFull
	}
	return p
}

// Validate reports a policy that cannot work, naming the field.
func (p Policy) Validate() error {
	var errs []error
	if p.InitialInterval < 0 {
		errs = append(errs, fmt.Errorf("retry: InitialInterval %s is negative", p.InitialInterval))
	}
	if p.Multiplier < 1 || math.IsNaN(p.Multiplier) || math.IsInf(p.Multiplier, 0) {
		errs = append(errs, fmt.Errorf("retry: Multiplier %v must be a finite number >= 1", p.Multiplier))
	}
	if p.MaxInterval < p.InitialInterval {
		errs = append(errs, fmt.Errorf("retry: MaxInterval %s is below InitialInterval %s", p.MaxInterval, p.InitialInterval))
	}
	if p.MaxAttempts < -1 {
		errs = append(errs, fmt.Errorf("retry: MaxAttempts %d: want >= 1, or -1 for no limit", p.MaxAttempts))
	}
	if p.MaxElapsedTime < 0 {
		errs = append(errs, fmt.Errorf("retry: MaxElapsedTime %s is negative", p.MaxElapsedTime))
	}
	switch p.Jitter {
	case JitterFull, JitterEqual, JitterDecorrelated, JitterNone:
	default:
		errs = append(errs, fmt.Errorf("retry: unknown Jitter %q: want full, equal, decorrelated or none", p.Jitter))
	}
	return errors.Join(errs...)
}

// Exhausted reports whether no attempt may follow attempt number `attempt`
// (1-based), started `elapsed` after the first one.
func (p Policy) Exhausted(attempt int, elapsed time.Duration) bool {
	p = p.WithDefaults()
	if p.MaxAttempts > 0 && attempt >= p.MaxAttempts {
		return true
	}
	return p.MaxElapsedTime > 0 && elapsed >= p.MaxElapsedTime
}

// Next decides what follows the failure of attempt number `attempt`
// (1-based), made `elapsed` after the first attempt: ok false when no
// attempt may follow (Exhausted), else the jittered delay (Delay, prev as
// there) before the next one, cut with MaxElapsedTime set so that the next
// attempt starts no later than MaxElapsedTime after the first. So a
// duration budget holds whatever the jitter draws: attempts go on until
// it has passed, and the attempt made once it has is the last.
func (p Policy) Next(attempt int, elapsed, prev time.Duration) (delay time.Duration, ok bool) {
	p = p.WithDefaults()
	if p.Exhausted(attempt, elapsed) {
		return 0, false
	}
	delay = p.Delay(attempt, prev)
	if p.MaxElapsedTime > 0 {
		delay = min(delay, p.MaxElapsedTime-elapsed)
	}
	return max(delay, 0), true
}

// Backoff returns the exponential (un-jittered) delay after attempt
// number `attempt` (1-based): InitialInterval * Multiplier^(attempt-1),
// capped at MaxInterval.
func (p Policy) Backoff(attempt int) time.Duration {
	p = p.WithDefaults()
	if attempt < 1 {
		attempt = 1
	}
	d := float64(p.InitialInterval) * math.Pow(p.Multiplier, float64(attempt-1))
	if d > float64(p.MaxInterval) || math.IsInf(d, 0) || math.IsNaN(d) {
		return p.MaxInterval
	}
	return time.Duration(d)
}

// Delay returns the jittered delay to wait after attempt number `attempt`
// failed. prev is the previous delay returned (0 at the first retry); only
// the decorrelated strategy uses it.
func (p Policy) Delay(attempt int, prev time.Duration) time.Duration {
	p = p.WithDefaults()
	b := p.Backoff(attempt)
	switch p.Jitter {
	case JitterNone:
		return b
	case JitterEqual:
		return b/2 + randDuration(b-b/2)
	case JitterDecorrelated:
		if prev < p.InitialInterval {
			prev = p.InitialInterval
		}
		hi := prev * 3
		if hi > p.MaxInterval || hi < 0 {
			hi = p.MaxInterval
		}
		if hi <= p.InitialInterval {
			return hi
		}
		return p.InitialInterval + randDuration(hi-p.InitialInterval)
	default: // JitterFull
		return randDuration(b)
	}
}

// randDuration returns a uniform duration in [0, d].
func randDuration(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return time.Duration(rand.Int64N(int64(d) + 1))
}
