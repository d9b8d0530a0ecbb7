package transport

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/retry"
)

// ErrGaveUpWaiting is wrapped by Open's error when it stopped waiting for
// an unreachable broker: its ctx ended or Config.WaitForBroker passed. The
// error also wraps the last attempt's failure and, when ctx ended, ctx's
// error.
var ErrGaveUpWaiting = errors.New("gave up waiting for the broker")

// openWaiting opens cfg's kind through d, attempt after attempt while the
// failure is one waiting can fix (not retry.Permanent), until ctx ends or
// cfg.WaitForBroker passes; it logs each failure and tells cfg.OnWait.
func openWaiting(ctx context.Context, cfg Config, d Driver) (Backend, error) {
	logger := cfg.Logger
	if logger == nil {
		// A wait is never silent: without a Logger, the failures go to
		// slog's default logger (stderr).
		logger = watermill.NewSlogLogger(nil)
	}
	start := time.Now()
	var prev time.Duration
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
		if cfg.WaitForBroker == NoWait || retry.IsPermanent(err) || ctx.Err() != nil {
			if ctx.Err() != nil && attempt > 1 {
				return nil, gaveUp(ctx, cfg, attempt, start, err)
			}
			return nil, fmt.Errorf("transport: opening %s: %w", cfg, err)
		}
		delay := WaitPolicy.Delay(attempt, prev)
		prev = delay
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
