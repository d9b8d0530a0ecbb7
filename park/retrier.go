package park

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/retry"
)

// ErrProduced is returned (wrapped, permanent) when a handler run by the
// retrier returns messages and Config.Publish is not set.
var ErrProduced = errors.New("park: a retried handler returned messages to publish but Config.Publish is not set")

type retriedKey struct{}

// Retried reports whether ctx is a message's context given by the
// retrier (the message was parked), and the round (1-based).
func Retried(ctx context.Context) (round int, ok bool) {
	round, ok = ctx.Value(retriedKey{}).(int)
	return round, ok
}

// Run retries due parked keys of the handlers whose Middleware was applied
// (the router applies middlewares when it starts: start Run once the
// router is running), up to Config.Concurrency keys at once: a slow
// round holds its own slot only. It runs until ctx ends or Close is
// called, then waits for its rounds in flight. A database error is logged
// and retried at the next poll; Run returns nil when stopped.
//
// Run, Close and Running follow the lifecycle of every long-running
// component (internal/runner, as outbox.Relay and saga.Orchestrator): Run
// once per Parker (a second call returns an error wrapping
// runner.ErrRunTwice at once); Run after Close returns nil at once.
func (p *Parker) Run(ctx context.Context) error {
	return p.run.Run(ctx, p.loop)
}

// loop is Run's loop on p.run: it claims due keys each poll (or when a
// round ends with room for more) until ctx ends or Close drains it, then
// waits for the rounds in flight. Close cancels their context at once.
func (p *Parker) loop(ctx context.Context, draining <-chan struct{}) error {
	if err := p.conflict(); err != nil {
		return fmt.Errorf("park: Run: %w", err)
	}
	var (
		wg    sync.WaitGroup
		slots = make(chan struct{}, p.cfg.Concurrency)
		t     = time.NewTimer(0)
	)
	defer wg.Wait()
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-draining:
			return nil
		case <-t.C:
		case <-p.wake:
		}
		n := p.startRounds(ctx, &wg, slots)
		next := p.cfg.PollInterval
		if n > 0 && len(slots) < cap(slots) {
			next = 0 // more may be due, and there is room
		}
		t.Reset(next)
	}
}

// startRounds claims as many due keys as slots are free and starts a
// round on each, returning how many it started. A round ending frees its
// slot and wakes Run.
func (p *Parker) startRounds(ctx context.Context, wg *sync.WaitGroup, slots chan struct{}) int {
	free := cap(slots) - len(slots)
	names := p.handlerNames()
	if free == 0 || len(names) == 0 {
		return 0
	}
	claims, err := storage.ClaimParked(ctx, p.pool, names, free, p.cfg.Lease)
	if err != nil {
		if ctx.Err() == nil {
			p.cfg.Logger.Error("Claiming due parked keys failed"+storage.Hint(err)+"; trying again at the next poll", err, nil)
		}
		return 0
	}
	for _, c := range claims {
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots; p.poke() }()
			if err := p.retryKeySafely(ctx, c); err != nil && ctx.Err() == nil {
				p.cfg.Logger.Error("Retrying a parked key failed; it is due again after Config.Lease", err, watermill.LogFields{"handler": c.Handler, "key": keyText(c.Key)})
			}
		}()
	}
	return len(claims)
}

// Running is closed once Run has started (or returned at once because
// Close came first).
func (p *Parker) Running() <-chan struct{} { return p.run.Running() }

// Close stops Run, waiting for its rounds in flight (their handlers get a
// cancelled context at once). It is idempotent, safe from several
// goroutines, and returns at once when Run never started (a later Run then
// returns nil at once).
func (p *Parker) Close() error { return p.run.Close() }

// RetryDue runs one round synchronously: it claims the due keys of the
// registered handlers (at most Config.Concurrency), retries their head
// messages concurrently and returns, when all are done, how many keys it
// claimed. It is for callers with their own loop (and tests); Run does the
// same continuously.
func (p *Parker) RetryDue(ctx context.Context) (int, error) {
	names := p.handlerNames()
	if len(names) == 0 {
		return 0, nil
	}
	claims, err := storage.ClaimParked(ctx, p.pool, names, p.cfg.Concurrency, p.cfg.Lease)
	if err != nil {
		return 0, fmt.Errorf("park: claiming due parked keys%s: %w", storage.Hint(err), err)
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, c := range claims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.retryKeySafely(ctx, c); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return len(claims), errors.Join(errs...)
}

// retryKeySafely is retryKey, with a panic of the round (outside the
// handler's own recovery: Config.Publish, a logger, park itself) recovered
// and the record set aside, so that no record kills the retrier.
func (p *Parker) retryKeySafely(ctx context.Context, c storage.ParkedClaim) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = p.setAside(ctx, c, "panic", fmt.Errorf("park: the retrier panicked on this record: %v\n%s", r, debug.Stack()))
		}
	}()
	return p.retryKey(ctx, c)
}

// setAside holds a claimed key whose record the retrier could not handle,
// recording why as its last error, logs it with the record and counts it
// (MetricSetAside): `millwright parked list` shows it held, `parked retry`
// runs it again once fixed, `parked release --force` drops it.
func (p *Parker) setAside(ctx context.Context, c storage.ParkedClaim, cause string, why error) error {
	p.stats.setAside.Add(1)
	if p.setAsideC != nil {
		p.setAsideC.WithLabelValues(c.Handler, cause).Inc()
	}
	fields := watermill.LogFields{"handler": c.Handler, "key": keyText(c.Key), "claim": c.Claim, "cause": cause}
	if c.Head != nil {
		fields["message_uuid"], fields["parked_message_id"], fields["topic"] = c.Head.MessageUUID, c.Head.ID, c.Head.Topic
	}
	p.cfg.Logger.Error("Parked record set aside: the key is held for an operator (`millwright parked list`, then `parked retry` or `parked release --force`)", why, fields)
	msg := why.Error()
	if len(msg) > 4000 {
		msg = msg[:4000]
	}
	if err := p.lost(storage.HoldParked(context.WithoutCancel(ctx), p.pool, c.Handler, c.Key, c.Claim, storable(msg))); err != nil {
		return fmt.Errorf("park: handler %q key %s: holding a record set aside (%v) failed; it is due again after Config.Lease: %w", c.Handler, keyText(c.Key), why, err)
	}
	return nil
}

// keepClaim extends the claim of c every third of Config.Lease while its
// round runs, so that a live retrier's round is never claimed again by
// another (which would run the head twice at once and, with an
// idempotency mark written after success, apply its effect after the
// key's next message). When the claim is lost anyway (the retrier stalled
// past the lease, or an operator released the key) the round's context is
// cancelled. Stop it with the returned func, which waits for it.
func (p *Parker) keepClaim(ctx context.Context, c storage.ParkedClaim, lost context.CancelFunc) (stop func()) {
	done, quit := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(p.cfg.Lease / 3)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			err := storage.ExtendParked(ctx, p.pool, c.Handler, c.Key, c.Claim, p.cfg.Lease)
			if errors.Is(err, storage.ErrParkedClaimLost) {
				p.cfg.Logger.Info("Parked key claim lost while its round ran (an operator released or held it, or the retrier stalled past Config.Lease); the round is cancelled", watermill.LogFields{"handler": c.Handler, "key": keyText(c.Key)})
				lost()
				return
			}
			if err != nil && ctx.Err() == nil {
				p.cfg.Logger.Error("Extending a parked key's claim failed; trying again (the claim lapses after Config.Lease)", err, watermill.LogFields{"handler": c.Handler, "key": keyText(c.Key)})
			}
		}
	}()
	return func() { close(quit); <-done }
}

// resolver resolves the dead letter of a claimed key's head once the head
// was applied, in the transaction that removes it (dlq.ResolveTx).
func (p *Parker) resolver(c storage.ParkedClaim) func(context.Context, storage.Tx, int64) error {
	return func(ctx context.Context, tx storage.Tx, id int64) error {
		ok, err := dlq.ResolveTx(ctx, storage.AsTx(tx), id, dlq.Resolution{Actor: "park retrier/" + c.Handler,
			Args: []string{"--handler=" + c.Handler, "--key=" + keyText(c.Key), "--message=" + c.Head.MessageUUID}})
		if errors.Is(err, dlq.ErrNotAudited) {
			p.cfg.Logger.Error("Dead letter applied through park but left dead: the audit table is missing", err, watermill.LogFields{"handler": c.Handler, "dead_letter_id": id})
			return nil
		}
		if err != nil {
			return err
		}
		if ok {
			p.cfg.Logger.Info("Dead letter resolved: its message was applied through park", watermill.LogFields{
				"handler": c.Handler, "key": keyText(c.Key), "message_uuid": c.Head.MessageUUID, "dead_letter_id": id})
		}
		return nil
	}
}

// retryKey runs one claimed key's head message once and records the
// outcome.
func (p *Parker) retryKey(ctx context.Context, c storage.ParkedClaim) error {
	h := p.handler(c.Handler)
	if c.Head == nil {
		// The messages were deleted by hand: release the key.
		return p.lost(storage.CompleteParked(context.WithoutCancel(ctx), p.pool, c.Handler, c.Key, c.Claim, 0, nil))
	}
	round := c.Rounds + 1
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg, err := p.message(rctx, c, round)
	if errors.Is(err, storage.ErrParkedMetadata) {
		return p.setAside(ctx, c, "bad_row", err)
	}
	if err != nil {
		return err
	}
	stop := p.keepClaim(rctx, c, cancel)
	herr := func() error {
		defer stop()
		produced, herr := callRecovering(h, msg)
		if herr == nil && len(produced) > 0 {
			herr = p.publish(c.Handler, produced)
		}
		return herr
	}()
	if errors.Is(herr, errPanicked) {
		// A panic that no middleware inside park recovered: a bug in the
		// handler, not a failure the backoff can wait out.
		return p.setAside(ctx, c, "handler_panic", herr)
	}
	wctx := context.WithoutCancel(ctx)
	if herr == nil {
		if err := p.lost(storage.CompleteParked(wctx, p.pool, c.Handler, c.Key, c.Claim, c.Head.ID, p.resolver(c))); err != nil {
			return fmt.Errorf("park: handler %q key %s: message %s succeeded but its parked row was not removed (it will run again; idempotency keeps it once): %w",
				c.Handler, keyText(c.Key), c.Head.MessageUUID, err)
		}
		p.countRetry(c.Handler, "ok")
		p.poke()
		return nil
	}
	if !retry.Final(herr) {
		// Shutting down: due again at once, same budget, for the next
		// retrier (without waiting out the lease).
		return p.lost(storage.RescheduleParked(wctx, p.pool, c.Handler, c.Key, c.Claim, failureAfter(c, 0, c.PrevDelay, herr, c.Rounds)))
	}
	f := dlq.Describe(herr)
	f.Attempts += c.Attempts
	if c.FirstFailure.Valid {
		f.FirstFailure = c.FirstFailure.Time
	}
	if delay, ok := p.nextDelay(round, since(f.FirstFailure), c.PrevDelay); ok && !failure.IsPermanent(herr) {
		p.countRetry(c.Handler, "failed")
		ff := failureAfter(c, delay, delay, herr, round)
		ff.Attempts, ff.FirstFailure = f.Attempts, f.FirstFailure
		return p.lost(storage.RescheduleParked(wctx, p.pool, c.Handler, c.Key, c.Claim, ff))
	}
	return p.deadLetterHead(wctx, c, round, f, herr)
}

// nextDelay decides what follows the failure of round `round`: ok false
// when the budget is spent, else the jittered delay. The first round came
// after Delay(1) (see handle), so round n is followed by Delay(n+1); with
// MaxElapsedTime the next round starts no later than the budget's end.
func (p *Parker) nextDelay(round int, elapsed, prev time.Duration) (time.Duration, bool) {
	if p.cfg.Retry.Exhausted(round, elapsed) {
		return 0, false
	}
	d := p.cfg.Retry.Delay(round+1, prev)
	if p.cfg.Retry.MaxElapsedTime > 0 {
		d = min(d, p.cfg.Retry.MaxElapsedTime-elapsed)
	}
	return max(d, 0), true
}

// deadLetterHead records the dead letter of a claimed key's head, with
// what Config.OnDeadLetter says for the key.
func (p *Parker) deadLetterHead(ctx context.Context, c storage.ParkedClaim, round int, f dlq.Failure, cause error) error {
	row := p.deadLetterRow(c.Handler, *c.Head, f)
	hold := p.cfg.OnDeadLetter == Hold
	id, err := storage.DeadLetterParked(ctx, p.pool, c.Claim, c.Head.ID, round, row, c.Key, hold, p.recordDeadLetter(c.Handler, *c.Head, f))
	if err := p.lost(err); err != nil {
		return fmt.Errorf("park: handler %q key %s: recording the dead letter of message %s (it stays parked, retried after the lease): %w",
			c.Handler, keyText(c.Key), c.Head.MessageUUID, err)
	}
	p.countRetry(c.Handler, "dead_letter")
	p.logDeadLetter(c.Handler, *c.Head, f, id, cause)
	if !hold {
		p.poke()
	}
	return nil
}

// failureAfter is the failure state after a round of c.
func failureAfter(c storage.ParkedClaim, due, prev time.Duration, err error, rounds int) storage.ParkFailure {
	now := time.Now()
	f := storage.ParkFailure{DueIn: due, Attempts: c.Attempts, Rounds: rounds, PrevDelay: prev, FirstFailure: now, LastFailure: now, LastError: dlq.Describe(err).Error}
	if c.FirstFailure.Valid {
		f.FirstFailure = c.FirstFailure.Time
	}
	return f
}

// lost drops ErrParkedClaimLost: another retrier took the key over (its
// lease passed) and records the outcome itself.
func (p *Parker) lost(err error) error {
	if errors.Is(err, storage.ErrParkedClaimLost) {
		p.cfg.Logger.Info("Parked key claim lost to another retrier (round longer than Config.Lease?); its outcome is theirs", watermill.LogFields{"error": err.Error()})
		return nil
	}
	return err
}

// message rebuilds the parked message for a round.
func (p *Parker) message(ctx context.Context, c storage.ParkedClaim, round int) (*message.Message, error) {
	msg := message.NewMessage(c.Head.MessageUUID, c.Head.Payload)
	md, err := storage.DecodeParkedMetadata(c.Head.Metadata)
	if err != nil {
		return nil, fmt.Errorf("park: decoding metadata of parked message %s (id %d): %w", c.Head.MessageUUID, c.Head.ID, err)
	}
	msg.Metadata = md
	msg.SetContext(context.WithValue(ctx, retriedKey{}, round))
	return msg, nil
}

func (p *Parker) publish(handler string, msgs []*message.Message) error {
	if p.cfg.Publish == nil {
		return failure.Permanent(fmt.Errorf("%w (handler %q returned %d)", ErrProduced, handler, len(msgs)))
	}
	if err := p.cfg.Publish(handler, msgs); err != nil {
		return fmt.Errorf("park: publishing the %d messages handler %q produced: %w", len(msgs), handler, err)
	}
	return nil
}
