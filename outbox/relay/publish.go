package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/tracing"
)

// errLeaseEnded is why the rows of a broker call that had not returned by
// its batch's bound, shortly before the lanes' lease ends, stay pending.
var errLeaseEnded = errors.New("the broker did not answer before the publish's bound, a tenth of relay.Config.Lease before the lanes' lease ends; " +
	"the rows stay pending and go out again, from the relay holding their lanes then (raise Lease if the broker is slow rather than stuck)")

// cutError is the result of a row whose broker call the batch's bound (or
// the relay stopping) cut short: the row is not sent as far as the relay
// knows, and the attempt is not a failure (it burns no retry budget).
type cutError struct {
	why error // errLeaseEnded, or the relay's context's error
	err error // what the call returned, if it returned
}

func (e *cutError) Error() string {
	if e.err == nil {
		return "outbox relay: not published: " + e.why.Error()
	}
	return "outbox relay: not published: " + e.why.Error() + ": " + e.err.Error()
}

func (e *cutError) Unwrap() []error {
	if e.err == nil {
		return []error{e.why}
	}
	return []error{e.why, e.err}
}

// isCut reports whether err is a row's cutError.
func isCut(err error) bool {
	var ce *cutError
	return errors.As(err, &ce)
}

// outcome collects a batch's per-row results from its broker calls. A
// call may outlive the publish stage (a publisher that does not stop at
// its messages' context): once the stage has closed the outcome, a late
// call's results are dropped, and the calls still running are counted in
// stuck until they return.
type outcome struct {
	mu       sync.Mutex
	results  []error
	answered []bool
	running  int // calls started that have not returned
	closed   bool
	stuck    *atomic.Int64
	wg       sync.WaitGroup
}

// start registers a goroutine about to make broker calls.
func (o *outcome) start() {
	o.mu.Lock()
	o.running++
	o.mu.Unlock()
	o.wg.Add(1)
}

// done unregisters it once its calls have returned.
func (o *outcome) done() {
	defer o.wg.Done()
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		o.stuck.Add(-1)
		return
	}
	o.running--
}

// record records the rows idx of a call that returned err (errs[j], when
// errs is not nil, is row idx[j]'s own), cut when ctx was done by then;
// nothing once the stage has closed the outcome.
func (o *outcome) record(ctx context.Context, idx []int, err error, errs map[int]error) {
	cut := ctx.Err() != nil
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return
	}
	for j, i := range idx {
		e := err
		if errs != nil {
			e = errs[j]
		}
		if e != nil && cut {
			e = &cutError{why: cause(ctx), err: e}
		}
		o.results[i], o.answered[i] = e, true
	}
}

// wait waits for the calls until ctx is done and grace after, then closes
// the outcome and returns the results.
func (o *outcome) wait(ctx context.Context, grace time.Duration) []error {
	done := make(chan struct{})
	go func() {
		o.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		t := time.NewTimer(grace)
		select {
		case <-done:
		case <-t.C:
		}
		t.Stop()
	}
	return o.close(ctx)
}

// close ends the stage: rows not answered are cut, and the calls still
// running count in stuck until they return.
func (o *outcome) close(ctx context.Context) []error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closed = true
	o.stuck.Add(int64(o.running))
	for i, ok := range o.answered {
		if !ok {
			o.results[i] = &cutError{why: cause(ctx)}
		}
	}
	return o.results
}

// cause is why a publish context is done: the lease bound, or the relay's
// own context (stopping).
func cause(ctx context.Context) error {
	if errors.Is(context.Cause(ctx), errLeaseEnded) {
		return errLeaseEnded
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return errLeaseEnded // not done: a call abandoned at the bound's grace
}

// publish is the second stage of a round: it sends the rows, their
// messages carrying ctx, and returns one error per row (nil: accepted). ctx
// ends at the batch's bound (see Config.Lease): the stage waits for
// the broker calls until then and grace after (for the calls to return
// what they had), then returns; rows not answered by then are cut
// (cutError), and a call still running is left to finish (Relay.stuck).
func (r *Relay) publish(ctx context.Context, rows []row, grace time.Duration) []error {
	o := &outcome{results: make([]error, len(rows)), answered: make([]bool, len(rows)), stuck: &r.stuck}
	for i := range rows {
		rows[i].msg.SetContext(ctx)
	}
	if r.batch != nil {
		r.publishTopics(ctx, rows, byTopic(rows, nil), o)
	} else {
		r.publishShares(ctx, rows, o)
	}
	return o.wait(ctx, grace)
}

// publishShares sends the rows with Publish. Aggregates are spread over
// PublishConcurrency workers; each sends its share with one Publish call
// per topic, in id order, so each aggregate stays in order and a transport
// whose Publish takes many messages at once gets them at once. A failed
// call fails all its messages: some may have gone out and will go again
// (at-least-once). A worker whose context is done starts no more calls.
func (r *Relay) publishShares(ctx context.Context, rows []row, o *outcome) {
	for _, share := range byAggregate(rows, min(r.cfg.PublishConcurrency, len(rows))) {
		o.start()
		go func() {
			defer o.done()
			for _, idx := range byTopic(rows, share) {
				if ctx.Err() != nil {
					return // the rest are not answered: cut
				}
				topic := rows[idx[0]].topic
				r.call(ctx, rows, idx, func(msgs []*message.Message) error { return r.pub.Publish(topic, msgs...) },
					func(idx []int, err error) { o.record(ctx, idx, err, nil) })
			}
		}()
	}
}

// publishTopics sends each topic's rows with one PublishBatch call, up to
// PublishConcurrency topics at once, starting none once ctx is done.
// Topics are independent: an aggregate's rows of one topic keep their
// order within the topic's call, and the mark stage judges each aggregate
// across all its topics as before (nothing after a failed row counts as
// published). Sending the topics one after another instead cost a broker
// round trip each: a saga's commands, one topic per step, went out three
// calls in a row, where a producer merges concurrent calls into one
// request.
func (r *Relay) publishTopics(ctx context.Context, rows []row, groups [][]int, o *outcome) {
	slots := make(chan struct{}, r.cfg.PublishConcurrency)
	for _, idx := range groups {
		if ctx.Err() != nil {
			return // the rest are not answered: cut
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return
		}
		o.start()
		go func() {
			defer func() { <-slots }()
			defer o.done()
			r.publishBatch(ctx, rows, idx, o)
		}()
	}
}

// publishBatch sends the rows idx, all of one topic, with one PublishBatch
// call and records each row's result.
func (r *Relay) publishBatch(ctx context.Context, rows []row, idx []int, o *outcome) {
	topic := rows[idx[0]].topic
	r.call(ctx, rows, idx, func(msgs []*message.Message) error { return r.batch.PublishBatch(topic, msgs...) },
		func(idx []int, err error) { recordBatch(ctx, idx, err, o) })
}

// recordBatch records the result err of a PublishBatch call of the rows
// idx: a *batch.Error names the rows that failed.
func recordBatch(ctx context.Context, idx []int, err error, o *outcome) {
	var be *batch.Error
	if err == nil || !errors.As(err, &be) {
		o.record(ctx, idx, err, nil)
		return
	}
	errs := make(map[int]error, len(be.Failed))
	for j, e := range be.Failed {
		if j >= 0 && j < len(idx) {
			errs[j] = e
		}
	}
	o.record(ctx, idx, nil, errs)
}

// call makes one broker call (send) of the rows idx, all of one topic,
// with observe, and passes its result to record. A panic of the publisher
// is recovered (logged with the rows, counted in MetricLoopPanics): the
// relay goes on. Which message of a call of several made it panic is not
// known, so each is then sent again alone; a row whose own call panics is
// failed at once (a failure.Permanent error naming the panic), set aside for
// an operator (`millwright outbox retry-failed` once the publisher is
// fixed), so that one poisonous row neither stops the relay nor holds its
// lane for the whole retry budget.
func (r *Relay) call(ctx context.Context, rows []row, idx []int, send func([]*message.Message) error, record func([]int, error)) {
	topic := rows[idx[0]].topic
	err := r.guard.Do("publishing", rowFields(rows, idx), func() error { return r.observe(topic, messages(rows, idx), send) })
	if !runner.IsPanic(err) {
		record(idx, err)
		return
	}
	if len(idx) == 1 {
		rw := rows[idx[0]]
		record(idx, failure.Permanent(fmt.Errorf("outbox relay: the publisher panicked on event %s (row %d, topic %q); the row is failed: fix the publisher or the event, then `millwright outbox retry-failed` (the stack is in the relay's log): %w",
			rw.msg.UUID, rw.id, topic, err)))
		return
	}
	for _, i := range idx {
		if ctx.Err() != nil {
			return // the rest are not answered: cut
		}
		r.call(ctx, rows, []int{i}, send, record)
	}
}

// rowFields are the log fields naming the rows idx: the first row's id,
// event id, topic and aggregate, and how many rows.
func rowFields(rows []row, idx []int) watermill.LogFields {
	rw := rows[idx[0]]
	return watermill.LogFields{"id": rw.id, "message_uuid": rw.msg.UUID, "topic": rw.topic,
		"aggregate_type": rw.aggType, "aggregate_id": rw.aggID, "rows": len(idx)}
}

// observe runs one broker call with its spans and latency metric. Without
// a tracer that records, a span would only carry the stored trace context
// over unchanged: the messages go out as they are.
func (r *Relay) observe(topic string, msgs []*message.Message, call func([]*message.Message) error) error {
	start := time.Now()
	end := func(error) {}
	if r.tr.Recording() {
		end = r.tr.RelayPublish(topic, msgs...)
	}
	err := call(msgs)
	end(err)
	r.m.latency.Observe(time.Since(start).Seconds())
	return err
}

// byTopic groups the rows idx (all rows when nil) by topic, in order of
// first appearance, keeping their order within each topic.
func byTopic(rows []row, idx []int) [][]int {
	if idx == nil {
		idx = make([]int, len(rows))
		for i := range rows {
			idx[i] = i
		}
	}
	pos := map[string]int{}
	var groups [][]int
	for _, i := range idx {
		g, ok := pos[rows[i].topic]
		if !ok {
			g = len(groups)
			pos[rows[i].topic] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups
}

// byAggregate spreads the rows over at most n shares, all rows of an
// aggregate in one share, in order.
func byAggregate(rows []row, n int) [][]int {
	shares := make([][]int, n)
	slot := map[string]int{}
	for i, rw := range rows {
		w, ok := slot[rw.aggKey]
		if !ok {
			w = len(slot) % n
			slot[rw.aggKey] = w
		}
		shares[w] = append(shares[w], i)
	}
	return nonEmpty(shares)
}

func nonEmpty(shares [][]int) [][]int {
	out := shares[:0]
	for _, s := range shares {
		if len(s) > 0 {
			out = append(out, s)
		}
	}
	return out
}

func messages(rows []row, idx []int) []*message.Message {
	msgs := make([]*message.Message, len(idx))
	for j, i := range idx {
		msgs[j] = rows[i].msg
	}
	return msgs
}

// mark is the third stage of a round: rows published are marked so; within
// an aggregate nothing after a failure counts as published (it goes out
// again after the failed row: at-least-once, in order for a consumer that
// drops duplicates), and the failures back off or fail for good. A row
// whose publish was cut (cutError) is neither: it and the rest of its
// aggregate stay pending as they were. Both statements write only rows of
// lanes the batch's owner still holds under a live lease (heldByOwner): a
// relay that lost its lanes, say while stalled after the publish, writes
// nothing, and the lanes' new holder publishes the rows again. It returns
// the earliest backoff it scheduled and the number of failures.
//
// ctx bounds the statements (the lanes' lease); run, the relay's own
// context, bounds the dead-letter copies, which no lane waits on.
func (r *Relay) mark(ctx, run context.Context, lease batchLease, rows []row, results []error) (time.Time, int, error) {
	blocked := map[string]bool{}
	var published []int64
	var failed []int
	cut := 0
	var cutErr error
	for i, rw := range rows {
		switch {
		case blocked[rw.aggKey]:
		case results[i] == nil:
			published = append(published, rw.id)
		case isCut(results[i]):
			blocked[rw.aggKey] = true
			cut++
			if cutErr == nil {
				cutErr = results[i]
			}
		default:
			blocked[rw.aggKey] = true
			failed = append(failed, i)
		}
	}
	if r.afterPublish != nil {
		r.afterPublish(ctx, published)
	}
	var errs []error
	if cut > 0 {
		r.cutBatches.Add(1)
		errs = append(errs, fmt.Errorf("outbox relay: %d row(s) of a batch of %d left pending: %w", cut, len(rows), cutErr))
	}
	if len(published) > 0 {
		// One round trip, one statement that commits without waiting for
		// the WAL flush. A server crash may undo the last marks; their
		// rows, still pending, are published again, in order, as after a
		// relay crash before its mark.
		k, err := storage.MarkPublished(ctx, r.db, lease.owner, published)
		if err != nil {
			errs = append(errs, fmt.Errorf("outbox relay: marking %d row(s) published (they will be published again): %w", len(published), err))
		} else {
			n := len(published)
			if int(k) < n {
				n = int(k)
				r.cfg.Logger.Error("outbox relay: published rows not marked: their lanes are no longer this relay's (their lease ended: a round longer than relay.Config.Lease) or another relay marked them; they stay pending and go out again (duplicates)",
					nil, watermill.LogFields{"published": len(published), "marked": k})
			}
			r.m.published.Add(float64(n))
			r.stats.published.Add(uint64(n))
		}
	}
	var next time.Time
	if len(failed) > 0 {
		n, err := r.fail(ctx, run, lease, rows, results, failed)
		next = n
		errs = append(errs, err)
	}
	return next, len(failed), errors.Join(errs...)
}

// fail records failed attempts: a backoff, during which the claim holds
// back the row's aggregate (see storage.ClaimEvents), or the failed state once the
// retry budget is spent (Config.Retry: its first failure older than
// MaxElapsedTime, or MaxAttempts reached) or the error is permanent
// (failure.Permanent). The rows it made failed are then copied to the
// dead-letter topic: after the UPDATE, so that an UPDATE that fails (its
// rows are claimed and fail again) sends no copy, and a row is
// dead-lettered at most once per failure.
func (r *Relay) fail(ctx, run context.Context, lease batchLease, rows []row, results []error, idx []int) (time.Time, error) {
	attempts := make([]storage.FailedAttempt, len(idx))
	final := make([]bool, len(idx))
	byID := make(map[int64]int, len(idx)) // id -> k
	now := time.Now()
	for k, i := range idx {
		rw := rows[i]
		byID[rw.id] = k
		r.m.publishErrors.Inc()
		d, ok := r.retryAfter(rw, results[i], now)
		final[k] = !ok
		attempts[k] = storage.FailedAttempt{ID: rw.id, Delay: d, Error: results[i].Error(), Final: !ok}
	}
	recs, err := storage.RecordFailures(ctx, r.db, lease.owner, attempts)
	if err != nil {
		// The statement may not have committed: send no dead letter.
		return time.Time{}, fmt.Errorf("outbox relay: recording %d failed publish(es): %w", len(attempts), err)
	}
	type recorded struct {
		k           int
		first, last time.Time // the database's clock
	}
	var done []recorded
	for _, rec := range recs {
		if k, ok := byID[rec.ID]; ok {
			done = append(done, recorded{k, rec.FirstFailed, rec.Now})
		}
	}
	if len(done) < len(attempts) {
		r.cfg.Logger.Error("outbox relay: failed publishes not recorded: their lanes are no longer this relay's (their lease ended) or the rows changed meanwhile; they stay pending as they were",
			nil, watermill.LogFields{"failed": len(attempts), "recorded": len(done)})
	}
	var next time.Time
	var dead []recorded
	for _, d := range done {
		if final[d.k] {
			dead = append(dead, d)
			continue
		}
		r.stats.retried.Add(1)
		if due := now.Add(attempts[d.k].Delay.Truncate(time.Millisecond)); next.IsZero() || due.Before(next) {
			next = due
		}
	}
	if len(dead) == 0 {
		return next, nil
	}
	// The copies get a bound of their own: their rows are failed, no
	// lane's order waits on them, but the round does.
	dctx, cancel := context.WithTimeout(run, r.cfg.Lease)
	defer cancel()
	for _, d := range dead {
		i := idx[d.k]
		rw := rows[i]
		r.m.failed.Inc()
		r.stats.failed.Add(1)
		fields := tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "attempts": rw.retryCount + 1})
		r.cfg.Logger.Error("outbox relay: event failed for good", results[i], fields)
		if r.cfg.DeadLetterTopic != "" && dctx.Err() != nil {
			// The copies' bound passed (a dead-letter broker that stopped
			// answering): starting more calls would only pile up more
			// stuck ones. The row stays failed, with its event.
			r.cfg.Logger.Error("outbox relay: dead-letter copy skipped: the copies' bound (relay.Config.Lease) passed; the row stays failed in the outbox", dctx.Err(), fields)
			continue
		}
		r.deadLetter(dctx, rw, results[i], d.first, d.last)
	}
	return next, nil
}

// retryAfter decides what follows the failed attempt of rw at now, with
// the retry budget counted from the row's first failure: ok false when
// the row fails for good (the policy is spent, or err is permanent), else
// the delay before its next attempt (jittered, and cut to end no later
// than the budget: see retry.Policy.Next).
func (r *Relay) retryAfter(rw row, err error, now time.Time) (time.Duration, bool) {
	if failure.IsPermanent(err) {
		return 0, false
	}
	return r.cfg.Retry.Next(rw.retryCount+1, rw.sinceFirstFailure(now), 0)
}

// deadLetter sends a copy of a failed event to the dead-letter topic, if
// one is configured, waiting at most until ctx is done (and a grace after:
// a publisher that ignores its message's context is left to finish, see
// Relay.stuck). The row is failed whatever happens here, so the event
// stays in the outbox for the operator.
func (r *Relay) deadLetter(ctx context.Context, rw row, cause error, first, last time.Time) {
	if r.cfg.DeadLetterTopic == "" {
		return
	}
	m := deadLetterMessage(rw, r.cfg.DeadLetterTopic, cause, rw.retryCount+1, first, last)
	m.SetContext(ctx)
	err := r.bounded(ctx, func() error { return r.pub.Publish(r.cfg.DeadLetterTopic, m) })
	if err != nil {
		r.cfg.Logger.Error("outbox relay: publishing to the dead-letter topic failed; the row stays failed in the outbox", err,
			tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "dead_letter_topic": r.cfg.DeadLetterTopic}))
		return
	}
	r.stats.deadLettered.Add(1)
}

// bounded runs call and waits for it until ctx is done and a grace
// (a twentieth of Lease) after; a call still running then is left to
// finish, counted in r.stuck until it does.
func (r *Relay) bounded(ctx context.Context, call func() error) error {
	o := &outcome{results: make([]error, 1), answered: make([]bool, 1), stuck: &r.stuck}
	o.start()
	go func() {
		defer o.done()
		// Its own goroutine: a publisher's panic here would end the
		// process (the dead-letter copy of a row whose publish panicked
		// carries the same message).
		o.record(ctx, []int{0}, r.guard.Do("publishing a dead-letter copy", nil, call), nil)
	}()
	return o.wait(ctx, r.cfg.Lease/20)[0]
}
