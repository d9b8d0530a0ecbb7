package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/tracing"
)

// publish is the second stage of a round: it sends the rows and returns
// one error per row (nil: accepted).
func (r *Relay) publish(rows []row) []error {
	results := make([]error, len(rows))
	if r.batch != nil {
		r.publishTopics(rows, byTopic(rows, nil), results)
		return results
	}
	// Aggregates are spread over PublishConcurrency workers; each sends its
	// share with one Publish call per topic, in id order, so each aggregate
	// stays in order and a transport whose Publish takes many messages at
	// once gets them at once. A failed call fails all its messages: some may
	// have gone out and will go again (at-least-once).
	var wg sync.WaitGroup
	for _, share := range byAggregate(rows, min(r.cfg.PublishConcurrency, len(rows))) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, idx := range byTopic(rows, share) {
				topic := rows[idx[0]].topic
				err := r.observe(topic, messages(rows, idx), func(msgs []*message.Message) error { return r.pub.Publish(topic, msgs...) })
				if err != nil {
					for _, i := range idx {
						results[i] = err
					}
				}
			}
		}()
	}
	wg.Wait()
	return results
}

// publishTopics sends each topic's rows with one PublishBatch call, up to
// PublishConcurrency topics at once. Topics are independent: an
// aggregate's rows of one topic keep their order within the topic's call,
// and the mark stage judges each aggregate across all its topics as
// before (nothing after a failed row counts as published). Sending the
// topics one after another instead cost a broker round trip each: a saga's
// commands, one topic per step, went out three calls in a row, where a
// producer merges concurrent calls into one request.
func (r *Relay) publishTopics(rows []row, groups [][]int, results []error) {
	if len(groups) == 1 {
		r.publishBatch(rows, groups[0], results)
		return
	}
	var wg sync.WaitGroup
	slots := make(chan struct{}, r.cfg.PublishConcurrency)
	for _, idx := range groups {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			r.publishBatch(rows, idx, results)
		}()
	}
	wg.Wait()
}

// publishBatch sends the rows idx, all of one topic, with one PublishBatch
// call and records each row's result.
func (r *Relay) publishBatch(rows []row, idx []int, results []error) {
	topic := rows[idx[0]].topic
	err := r.observe(topic, messages(rows, idx), func(msgs []*message.Message) error { return r.batch.PublishBatch(topic, msgs...) })
	var be *batch.Error
	switch {
	case err == nil:
	case errors.As(err, &be):
		for j, e := range be.Failed {
			if j >= 0 && j < len(idx) {
				results[idx[j]] = e
			}
		}
	default:
		for _, i := range idx {
			results[i] = err
		}
	}
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
// drops duplicates), and the failures back off or fail for good. It
// returns the earliest backoff it scheduled and the number of failures.
func (r *Relay) mark(ctx context.Context, rows []row, results []error) (time.Time, int, error) {
	blocked := map[string]bool{}
	var published []int64
	var failed []int
	for i, rw := range rows {
		switch {
		case blocked[rw.aggKey]:
		case results[i] == nil:
			published = append(published, rw.id)
		default:
			blocked[rw.aggKey] = true
			failed = append(failed, i)
		}
	}
	if r.afterPublish != nil {
		r.afterPublish(ctx, published)
	}
	var errs []error
	if len(published) > 0 {
		// One round trip, no parameters: one implicit transaction that
		// commits without waiting for the WAL flush. A server crash may
		// undo the last marks; their rows, still pending, are published
		// again, in order, as after a relay crash before its mark.
		if _, err := r.db.ExecContext(ctx, `SET LOCAL synchronous_commit = off; UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE id = ANY(`+idArray(published)+`) AND status = 'pending'`); err != nil {
			errs = append(errs, fmt.Errorf("outbox relay: marking %d row(s) published (they will be published again): %w", len(published), err))
		} else {
			r.m.published.Add(float64(len(published)))
			r.stats.published.Add(uint64(len(published)))
		}
	}
	var next time.Time
	if len(failed) > 0 {
		n, err := r.fail(ctx, rows, results, failed)
		next = n
		errs = append(errs, err)
	}
	return next, len(failed), errors.Join(errs...)
}

// idArray renders ids as a bigint[] literal, so that hot statements carry
// no parameters (one round trip with lib/pq instead of two).
func idArray(ids []int64) string {
	var b strings.Builder
	b.WriteString("'{")
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	b.WriteString("}'::bigint[]")
	return b.String()
}

// fail records failed attempts: a backoff, during which the claim holds
// back the row's aggregate (see claimedCTE), or the failed state once the
// retry policy is exhausted (with a copy to the dead-letter topic).
func (r *Relay) fail(ctx context.Context, rows []row, results []error, idx []int) (time.Time, error) {
	ids := make([]int64, len(idx))
	delays := make([]int64, len(idx))
	msgs := make([]string, len(idx))
	final := make([]bool, len(idx))
	var next time.Time
	now := time.Now()
	for k, i := range idx {
		rw := rows[i]
		attempt := rw.retryCount + 1
		ids[k] = rw.id
		msgs[k] = results[i].Error()
		r.m.publishErrors.Inc()
		if r.cfg.Retry.Exhausted(attempt, now.Sub(rw.createdAt)) {
			final[k] = true
			r.deadLetter(rw, results[i])
			r.cfg.Logger.Error("outbox relay: event failed for good", results[i], tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "attempts": attempt}))
			continue
		}
		d := r.cfg.Retry.Delay(attempt, 0)
		delays[k] = d.Milliseconds()
		r.stats.retried.Add(1)
		if due := now.Add(d); next.IsZero() || due.Before(next) {
			next = due
		}
	}
	if _, err := r.db.ExecContext(ctx, `UPDATE millwright_outbox t SET
		retry_count = t.retry_count + 1,
		last_error = u.err,
		status = CASE WHEN u.final THEN 'failed' ELSE 'pending' END,
		next_attempt_at = now() + u.delay_ms * interval '1 millisecond'
	FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bool[]) AS u(id, delay_ms, err, final)
	WHERE t.id = u.id AND t.status = 'pending'`,
		pq.Array(ids), pq.Array(delays), pq.Array(msgs), pq.Array(final)); err != nil {
		return next, fmt.Errorf("outbox relay: recording %d failed publish(es): %w", len(ids), err)
	}
	for _, f := range final {
		if f {
			r.m.failed.Inc()
			r.stats.failed.Add(1)
		}
	}
	return next, nil
}

// deadLetter sends a copy of a failed event to the dead-letter topic, if one
// is configured. The row is marked failed whatever happens here, so the
// event stays in the outbox for the operator.
func (r *Relay) deadLetter(rw row, cause error) {
	if r.cfg.DeadLetterTopic == "" {
		return
	}
	m := deadLetterMessage(rw, r.cfg.DeadLetterTopic, cause, rw.retryCount+1, time.Now())
	if err := r.pub.Publish(r.cfg.DeadLetterTopic, m); err != nil {
		r.cfg.Logger.Error("outbox relay: publishing to the dead-letter topic failed; the row stays failed in the outbox", err,
			tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "dead_letter_topic": r.cfg.DeadLetterTopic}))
		return
	}
	r.stats.deadLettered.Add(1)
}
