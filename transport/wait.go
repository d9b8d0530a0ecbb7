package transport

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/failure"
)

// ErrGaveUpWaiting is wrapped by Open's error when it stopped waiting for
// an unreachable broker: its ctx ended or Config.WaitForBroker passed. The
// error also wraps the last attempt's failure and, when ctx ended, ctx's
// error.
var ErrGaveUpWaiting = errors.New("gave up waiting for the broker")

// openWaiting opens cfg's kind through d, attempt after attempt while the
// failure is one waiting can fix (not failure.Permanent), until ctx ends or
// cfg.WaitForBroker passes; it logs each failure and tells cfg.OnWait.
func openWaiting(ctx context.Context, cfg Config, d Driver) (Backend, error) {
	logger := cfg.Logger
	if logger == nil {
		// A wait is never silent: without a Logger, the failures go to
		// slog's default logger (stderr).
		logger = watermill.NewSlogLogger(nil)
	}
	start := time.Now()
	for attempt := 1; ; attempt++ {
		b, err := d.Open(ctx, cfg)
		if err == nil {
			if attempt > 1 {
				logger.Info("Broker reached after waiting for it", watermill.LogFields{
					"transport": cfg.String(), "attempts": attempt, "waited": time.Since(start).Round(time.Millisecond).String(),
				})
			}
			return b, nil
		}
		if cfg.WaitForBroker == NoWait || failure.IsPermanent(err) || ctx.Err() != nil {
			if ctx.Err() != nil && attempt > 1 {
				return nil, gaveUp(ctx, cfg, attempt, start, err)
			}
			return nil, fmt.Errorf("transport: opening %s: %w", cfg, err)
		}
		delay := waitDelay(attempt)
		waited := time.Since(start)
		if cfg.WaitForBroker > 0 {
			// The last attempt comes at the bound, not a jittered delay
			// short of it.
			delay = min(delay, cfg.WaitForBroker-waited)
		}
		if cfg.WaitForBroker > 0 && delay <= 0 {
			return nil, fmt.Errorf("transport: opening %s: %w after %d attempts in %s (WaitForBroker %s): %w",
				cfg, ErrGaveUpWaiting, attempt, waited.Round(time.Millisecond), cfg.WaitForBroker, err)
		}
		logger.Error("Broker unreachable; waiting for it", err, watermill.LogFields{
			"transport": cfg.String(), "waiting_for": "the " + string(cfg.Kind) + " broker", "attempt": attempt,
			"retry_in": delay.Round(time.Millisecond).String(), "waited": waited.Round(time.Millisecond).String(),
		})
		if cfg.OnWait != nil {
			cfg.OnWait(err)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, gaveUp(ctx, cfg, attempt, start, err)
		case <-t.C:
		}
	}
}

func gaveUp(ctx context.Context, cfg Config, attempts int, start time.Time, last error) error {
	return fmt.Errorf("transport: opening %s: %w after %d attempts in %s (the start context ended: %w); last failure: %w",
		cfg, ErrGaveUpWaiting, attempts, time.Since(start).Round(time.Millisecond), context.Cause(ctx), last)
}

// Open's pace while it waits for a broker (see Config.WaitForBroker).
const (
	waitInitial = 500 * time.Millisecond
	waitMax     = 5 * time.Second
)

// waitDelay is the pause after Open's attempt number attempt failed: 0.5s,
// doubling, at most 5s, with full jitter (uniform up to that), as
// retry.Policy's default jitter, so that services that started together
// do not retry in lockstep; a broker back after a restart is reached
// within 5s.
func waitDelay(attempt int) time.Duration {
	d := waitMax
	if attempt < 5 { // 0.5s << 4 is past waitMax
		d = min(waitInitial<<max(attempt-1, 0), waitMax)
	}
	return time.Duration(rand.Int64N(int64(d) + 1))
}
