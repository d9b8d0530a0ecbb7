package dlq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
)

// ReplayOptions selects and paces a replay.
type ReplayOptions struct {
	// Filter selects the rows to replay. Rows already replayed (or
	// resolved: applied later through package park) are skipped unless
	// Force is set (Filter.Pending is then ignored).
	Filter Filter
	// Target is the topic to publish to. Default "": each row's original
	// topic.
	Target string
	// DryRun reports what would be published where, and publishes and marks
	// nothing.
	DryRun bool
	// Rate caps publishing at this many messages per second. Default 0: no
	// cap. Must be >= 0.
	Rate float64
	// Force replays rows already replayed or resolved, too (never a superseded row:
	// its edited copy replaced it).
	Force bool
	// For overrides the consumer the replays are for
	// (metadata.DeadLetterReplayFor). Default "": the consumer each dead
	// letter records. ReplayEveryConsumer: every consumer of the topic runs
	// them; a ReplayTarget value ("<consumer group>/<handler>"): that
	// consumer, e.g. the new name of a renamed group or handler, which no
	// longer matches its dead letters. Not used with a Target other than
	// the original topic.
	For string
	// Progress, if set, is called on Replay's goroutine after each selected
	// row is handled (published and marked, listed in a dry run, or skipped
	// as taken by a concurrent replay) with the number handled so far; a
	// progress report counts the rows to handle with CountSelected. Default
	// nil.
	Progress func(handled int)
}

// CountSelected returns how many rows a Replay with opts would handle
// now (the total of ReplayOptions.Progress): the rows the filter selects,
// without those already replayed unless opts.Force, at most Filter.Limit.
func (s *Store) CountSelected(ctx context.Context, opts ReplayOptions) (int, error) {
	f := opts.Filter
	f.Pending = !opts.Force
	n, err := s.Count(ctx, f)
	if err != nil {
		return 0, err
	}
	if f.Limit > 0 {
		n = min(n, f.Limit)
	}
	return n, nil
}

// ReplayItem is one dead letter replayed (or, in a dry run, to be replayed).
type ReplayItem struct {
	// ID is the row id.
	ID int64
	// MessageUUID is the UUID the message is published with (the original,
	// byte for byte).
	MessageUUID string
	// From is the dead letter's original topic; To the topic published to.
	From, To string
	// Error is the dead letter's recorded error, for the report.
	Error string
	// For is the consumer the replay is for (metadata.DeadLetterReplayFor,
	// see ReplayTarget), "" when it is for every consumer of To: a dead
	// letter that records no consumer, or a replay to another topic.
	For string
}

// ReplayReport says what a replay did.
type ReplayReport struct {
	// DryRun is true when nothing was published.
	DryRun bool
	// Items lists the messages published (or to be published), in order.
	Items []ReplayItem
	// SkippedReplayed counts rows the filter selected that were skipped
	// because they were no longer dead: replayed, superseded or resolved
	// before (0 with Force).
	SkippedReplayed int
	// SkippedConcurrent counts rows another replay took between selection
	// and publishing.
	SkippedConcurrent int
}

// Replay publishes the dead letters opts selects to their original topic
// (or opts.Target) through pub, oldest first, and marks each one replayed
// (replayed_at, replay_count). The replayed message has the original UUID,
// payload and metadata (trace context and event id included, so an
// idempotent consumer processes it at most once) plus
// metadata.DeadLetterReplayOf = the row id and, published to its original
// topic, metadata.DeadLetterReplayFor = the consumer that gave up on it
// (ReplayTarget): every consumer group on the topic receives the replay,
// and the others ack it without running their handler (dlq.Middleware and
// park's Middleware check it), so a group that applied the original does
// not apply it again after its idempotency marks expired. A dead letter
// that records no consumer (recorded before consumers were recorded, or
// by a middleware without a handler name and group) goes to every
// consumer of the topic; ReplayItem.For is then "". A consumer behind package
// park takes the replay for its parked copy's replacement (a held key's
// head is then applied in its place), not for a redelivery.
//
// Each row is locked (FOR UPDATE SKIP LOCKED) while it is published and
// marked, so concurrent replays do not publish it twice. If the marking
// fails after a successful publish, the row may be published again by a
// later replay: delivery is at least once. Replay stops at the first
// failed publish and returns the report so far with the error.
//
// Memory stays bounded whatever the backlog: rows are read 500 references
// at a time (id order, keyset paging) and each payload only inside its own
// transaction; the report keeps one small item per message.
func (s *Store) Replay(ctx context.Context, pub message.Publisher, opts ReplayOptions) (ReplayReport, error) {
	rep := ReplayReport{DryRun: opts.DryRun}
	if s.err != nil {
		return rep, s.err
	}
	if opts.Rate < 0 {
		return rep, fmt.Errorf("dlq: replay rate %v must be >= 0 (0 means unlimited)", opts.Rate)
	}
	if err := validReplayFor(opts.For); err != nil {
		return rep, err
	}
	if pub == nil && !opts.DryRun {
		return rep, errors.New("dlq: replay needs a message.Publisher unless it is a dry run")
	}
	if !opts.Force {
		skipped, err := s.countReplayed(ctx, opts.Filter)
		if err != nil {
			return rep, err
		}
		rep.SkippedReplayed = skipped
	}
	r := &replayer{store: s, pub: pub, opts: opts, rep: &rep, next: time.Now()}
	if opts.Rate > 0 {
		r.interval = time.Duration(float64(time.Second) / opts.Rate)
	}
	err := r.run(ctx)
	return rep, err
}

// countReplayed counts the rows f selects (without its limit) that were
// replayed before.
func (s *Store) countReplayed(ctx context.Context, f Filter) (int, error) {
	f.Pending, f.Limit = false, 0
	total, err := s.Count(ctx, f)
	if err != nil {
		return 0, err
	}
	f.Pending = true
	pending, err := s.Count(ctx, f)
	if err != nil {
		return 0, err
	}
	return total - pending, nil
}

// replayer is one Replay's state.
type replayer struct {
	store    *Store
	pub      message.Publisher
	opts     ReplayOptions
	rep      *ReplayReport
	interval time.Duration
	next     time.Time
	handled  int
}

// run replays page after page. Keyset paging by id: memory holds one page
// of row references (not payloads: replayOne reads each row in its own
// transaction), however many dead letters the filter selects.
func (r *replayer) run(ctx context.Context) error {
	f := r.opts.Filter
	f.Pending = !r.opts.Force
	page := r.store.replayPage
	if page <= 0 {
		page = defaultReplayPage
	}
	remaining := f.Limit
	for {
		pf := f
		pf.Limit = page
		if remaining > 0 {
			pf.Limit = min(page, remaining)
		}
		refs, err := r.store.listRefs(ctx, pf)
		if err != nil {
			return err
		}
		for _, d := range refs {
			if err := r.handle(ctx, d); err != nil {
				return err
			}
		}
		if len(refs) < pf.Limit {
			return nil
		}
		f.afterID = refs[len(refs)-1].id
		if remaining > 0 {
			if remaining -= len(refs); remaining == 0 {
				return nil
			}
		}
	}
}

// handle replays (or, in a dry run, lists) one row, paced by the rate.
func (r *replayer) handle(ctx context.Context, d rowRef) error {
	item := ReplayItem{ID: d.id, MessageUUID: d.uuid, From: d.topic, To: r.opts.Target, Error: d.err}
	if item.To == "" {
		item.To = d.topic
	}
	if item.To == "" {
		return fmt.Errorf("dlq: dead letter %d has no original topic recorded: pass a target topic", d.id)
	}
	if dl, err := r.store.Get(ctx, d.id); err == nil {
		item.For = dl.replayFor(item.To, r.opts.For)
	} else if !errors.Is(err, ErrNotFound) {
		return err
	}
	if !r.opts.DryRun {
		if err := r.pace(ctx); err != nil {
			return err
		}
		published, err := r.store.replayOne(ctx, r.pub, d.id, item.To, r.opts.Force, item.For)
		if err != nil {
			return err
		}
		if !published {
			r.rep.SkippedConcurrent++
			r.progress()
			return nil
		}
	}
	r.rep.Items = append(r.rep.Items, item)
	r.progress()
	return nil
}

// pace waits for the next publish the rate allows.
func (r *replayer) pace(ctx context.Context) error {
	if r.interval <= 0 {
		return nil
	}
	if err := sleepUntil(ctx, r.next); err != nil {
		return err
	}
	r.next = r.next.Add(r.interval)
	if now := time.Now(); r.next.Before(now) {
		r.next = now
	}
	return nil
}

func (r *replayer) progress() {
	r.handled++
	if r.opts.Progress != nil {
		r.opts.Progress(r.handled)
	}
}

// defaultReplayPage is how many row references Replay reads at a time.
const defaultReplayPage = 500

// rowRef is what Replay needs of a row before locking it.
type rowRef struct {
	id               int64
	uuid, topic, err string
}

// listRefs returns the references of the rows f selects, by id.
func (s *Store) listRefs(ctx context.Context, f Filter) ([]rowRef, error) {
	refs, err := storage.ListDeadLetterRefs(ctx, s.pool, f.selection())
	if err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters to replay (did `millwright migrate` run?): %w", err)
	}
	out := make([]rowRef, len(refs))
	for i, r := range refs {
		out[i] = rowRef{id: r.ID, uuid: r.MessageUUID, topic: r.Topic, err: r.Error}
	}
	return out, nil
}

// replayOne publishes and marks one row inside a transaction holding its
// lock. It returns false when the row was taken by another replay.
func (s *Store) replayOne(ctx context.Context, pub message.Publisher, id int64, topic string, force bool, target string) (bool, error) {
	tx, err := s.pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return false, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	defer func() {
		// Bounded, and run even when ctx has ended (no-op after Commit).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	row, ok, err := storage.LockDeadLetterForReplay(ctx, tx, id, force)
	if err != nil {
		return false, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	if !ok {
		return false, nil
	}
	d, err := deadLetter(row)
	if err != nil {
		return false, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	msg := message.NewMessage(d.MessageUUID, d.Payload)
	for k, v := range d.Metadata {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.DeadLetterReplayOf, strconv.FormatInt(d.ID, 10))
	setReplayFor(msg.Metadata, target)
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		return false, fmt.Errorf("dlq: publishing dead letter %d (message %s) to %q: %w; it stays unreplayed", d.ID, d.MessageUUID, topic, err)
	}
	if err := storage.MarkDeadLetterReplayed(ctx, tx, id); err != nil {
		return false, fmt.Errorf("dlq: dead letter %d was published to %q but marking it replayed failed (a later replay may publish it again): %w", id, topic, err)
	}
	if err := tx.Commit(ctx); err != nil {
		if s.commitLanded(ctx, tx, id, row.ReplayCount) {
			// The commit was cut (an interrupt cancels ctx) after the
			// server applied it: the row is marked, so count it.
			return true, nil
		}
		return false, fmt.Errorf("dlq: dead letter %d was published to %q but marking it replayed failed (a later replay may publish it again): %w", id, topic, err)
	}
	return true, nil
}

// commitLanded reports whether a commit that returned an error was applied
// anyway: row id's replay count is one past before. A cancelled context
// cuts the wait for the commit's answer, not the commit, so the outcome is
// read back on a fresh, bounded context, by a read that waits for the
// row's lock (the server ends the cut transaction one way or the other).
// Any doubt (the read fails) is false, which keeps the row counted as
// unmarked and the error reported.
func (s *Store) commitLanded(ctx context.Context, tx storage.Tx, id int64, before int) bool {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// A commit never sent leaves the transaction, and its lock, open on
	// this connection: end it first (a no-op when the driver already did).
	_ = tx.Rollback(rctx)
	n, err := storage.DeadLetterReplayCount(rctx, s.pool, id)
	return err == nil && n == before+1
}

func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
