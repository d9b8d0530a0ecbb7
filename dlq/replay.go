package dlq

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
)

// ReplayOptions selects and paces a replay.
type ReplayOptions struct {
	// Filter selects the rows to replay. Rows already replayed are skipped
	// unless Force is set (Filter.Pending is then ignored).
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
	// Force replays rows already replayed, too.
	Force bool
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
	// MessageUUID is the UUID the message is published with (the original).
	MessageUUID string
	// From is the dead letter's original topic; To the topic published to.
	From, To string
	// Error is the dead letter's recorded error, for the report.
	Error string
}

// ReplayReport says what a replay did.
type ReplayReport struct {
	// DryRun is true when nothing was published.
	DryRun bool
	// Items lists the messages published (or to be published), in order.
	Items []ReplayItem
	// SkippedReplayed counts rows the filter selected that were skipped
	// because they had been replayed before (0 with Force).
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
// metadata.DeadLetterReplayOf = the row id.
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
	if opts.Rate < 0 {
		return rep, fmt.Errorf("dlq: replay rate %v must be >= 0 (0 means unlimited)", opts.Rate)
	}
	if pub == nil && !opts.DryRun {
		return rep, errors.New("dlq: replay needs a message.Publisher unless it is a dry run")
	}
	f := opts.Filter
	f.Pending = !opts.Force
	if !opts.Force {
		all := opts.Filter
		all.Pending, all.Limit = false, 0
		total, err := s.Count(ctx, all)
		if err != nil {
			return rep, err
		}
		pendingAll := all
		pendingAll.Pending = true
		pending, err := s.Count(ctx, pendingAll)
		if err != nil {
			return rep, err
		}
		rep.SkippedReplayed = total - pending
	}

	var interval time.Duration
	if opts.Rate > 0 {
		interval = time.Duration(float64(time.Second) / opts.Rate)
	}
	next := time.Now()
	page := s.replayPage
	if page <= 0 {
		page = defaultReplayPage
	}
	// Keyset paging by id: memory holds one page of row references (not
	// payloads: replayOne reads each row in its own transaction), however
	// many dead letters the filter selects.
	remaining := f.Limit
	handled := 0
	progress := func() {
		handled++
		if opts.Progress != nil {
			opts.Progress(handled)
		}
	}
	for {
		pf := f
		pf.Limit = page
		if remaining > 0 {
			pf.Limit = min(page, remaining)
		}
		refs, err := s.listRefs(ctx, pf)
		if err != nil {
			return rep, err
		}
		for _, d := range refs {
			item := ReplayItem{ID: d.id, MessageUUID: d.uuid, From: d.topic, To: opts.Target, Error: d.err}
			if item.To == "" {
				item.To = d.topic
			}
			if item.To == "" {
				return rep, fmt.Errorf("dlq: dead letter %d has no original topic recorded: pass a target topic", d.id)
			}
			if opts.DryRun {
				rep.Items = append(rep.Items, item)
				progress()
				continue
			}
			if interval > 0 {
				if err := sleepUntil(ctx, next); err != nil {
					return rep, err
				}
				next = next.Add(interval)
				if now := time.Now(); next.Before(now) {
					next = now
				}
			}
			published, err := s.replayOne(ctx, pub, d.id, item.To, opts.Force)
			if err != nil {
				return rep, err
			}
			if !published {
				rep.SkippedConcurrent++
				progress()
				continue
			}
			rep.Items = append(rep.Items, item)
			progress()
		}
		if len(refs) < pf.Limit {
			return rep, nil
		}
		f.afterID = refs[len(refs)-1].id
		if remaining > 0 {
			if remaining -= len(refs); remaining == 0 {
				return rep, nil
			}
		}
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
	where, args := f.where()
	q := "SELECT id, message_uuid, original_topic, error FROM millwright_dead_letters" + where + " ORDER BY id"
	if f.Limit > 0 {
		q += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := s.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters to replay (did `millwright migrate` run?): %w", err)
	}
	defer rows.Close()
	var out []rowRef
	for rows.Next() {
		var r rowRef
		if err := rows.Scan(&r.id, &r.uuid, &r.topic, &r.err); err != nil {
			return nil, fmt.Errorf("dlq: reading dead letter to replay: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters to replay: %w", err)
	}
	return out, nil
}

// replayOne publishes and marks one row inside a transaction holding its
// lock. It returns false when the row was taken by another replay.
func (s *Store) replayOne(ctx context.Context, pub message.Publisher, id int64, topic string, force bool) (bool, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	defer func() { _ = tx.Rollback() }()
	d, err := scanDeadLetter(tx.QueryRowContext(ctx, "SELECT "+columns+
		" FROM millwright_dead_letters WHERE id = $1 AND (replayed_at IS NULL OR $2) FOR UPDATE SKIP LOCKED", id, force))
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	msg := message.NewMessage(d.MessageUUID, d.Payload)
	for k, v := range d.Metadata {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.DeadLetterReplayOf, strconv.FormatInt(d.ID, 10))
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		return false, fmt.Errorf("dlq: publishing dead letter %d (message %s) to %q: %w; it stays unreplayed", d.ID, d.MessageUUID, topic, err)
	}
	if _, err := tx.ExecContext(ctx, `UPDATE millwright_dead_letters SET replayed_at = now(), replay_count = replay_count + 1 WHERE id = $1`, id); err != nil {
		return false, fmt.Errorf("dlq: dead letter %d was published to %q but marking it replayed failed (a later replay may publish it again): %w", id, topic, err)
	}
	if err := tx.Commit(); err != nil {
		return false, fmt.Errorf("dlq: dead letter %d was published to %q but marking it replayed failed (a later replay may publish it again): %w", id, topic, err)
	}
	return true, nil
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
