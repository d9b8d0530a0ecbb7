package dlq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"maps"
	"slices"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// ReplayOptions selects and paces a replay.
type ReplayOptions struct {
	// Filter selects the rows to replay. Rows already replayed (or
	// resolved: applied later through package park) are skipped unless
	// Force is set (Filter.Pending is then ignored).
	Filter Filter
	// Target is the topic to replay to. Default "": each row's original
	// topic.
	Target string
	// DryRun reports what would be queued where, and queues and marks
	// nothing.
	DryRun bool
	// Rate caps queueing at this many messages per second. Default 0: no
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
	// row is handled (queued and marked, listed in a dry run, or skipped
	// as taken by a concurrent replay) with the number handled so far; a
	// progress report counts the rows to handle with CountReplay. Default
	// nil.
	Progress func(handled int)
	// By is the operator, for the audit row of each replayed dead letter
	// (ReplayTx). By.User is required unless DryRun.
	By audit.Operator

	// page is how many rows Replay reads at a time; 0 means
	// defaultReplayPage. Tests set it small.
	page int
}

// ReplayItem is one dead letter replayed (or, in a dry run, to be replayed).
type ReplayItem struct {
	// ID is the row id.
	ID int64
	// MessageUUID is the dead letter's message UUID, the replay's event id
	// unless its metadata names one (metadata.EventID).
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
	// DryRun is true when nothing was queued.
	DryRun bool
	// Items lists the messages queued (or to be queued), in order.
	Items []ReplayItem
	// SkippedReplayed counts rows the filter selected that were skipped
	// because they were no longer dead: replayed, superseded or resolved
	// before (0 with Force).
	SkippedReplayed int
	// SkippedConcurrent counts rows another replay took (or held) between
	// selection and queueing, or that were cleaned meanwhile.
	SkippedConcurrent int
}

// ErrNotDead is returned (wrapped) by ReplayTx when the dead letter is
// no longer dead (replayed, superseded by an edit, or resolved through
// park, before or by a concurrent replay holding its row), and not forced:
// nothing was queued.
var ErrNotDead = errors.New("dlq: the dead letter was already replayed, superseded or resolved")

// ErrNotReplayable is returned (wrapped) by ReplayTx and Replay for a dead
// letter the outbox cannot carry as it is: no original topic recorded (and
// no target), or a message UUID or metadata that is not text (a binary
// Kafka key or header: the outbox's metadata is JSONB). The error names
// the row and the fix; nothing was queued.
var ErrNotReplayable = errors.New("dlq: the dead letter cannot be replayed through the outbox")

// ReplayCommand and EditReplayCommand are the millwright_audit commands of
// a replayed dead letter (ReplayTx without and with an Edit): one row per
// dead letter, whoever replayed it (`millwright dlq replay`, whose run has
// its own row too, the console, a service).
const (
	ReplayCommand     = "replay dead letter"
	EditReplayCommand = "edit and replay dead letter"
)

// Edit is an operator's edit of a dead letter (the console's edit and
// replay): the payload, and the metadata when it was edited too.
type Edit struct {
	// Payload replaces the stored payload.
	Payload []byte
	// Metadata replaces the stored metadata; nil keeps it.
	Metadata map[string]string
}

// ReplayOneOptions says how ReplayTx replays one dead letter.
type ReplayOneOptions struct {
	// By is the operator, for the audit row. By.User is required.
	By audit.Operator
	// Target, Force and For are as in ReplayOptions.
	Target string
	Force  bool
	For    string
	// Edit, if not nil, replays an edited copy: the dead letter becomes
	// superseded (by the copy's event id) and is never replayed again.
	// Only a dead row can be edited (Force does not apply).
	Edit *Edit

	// bulk, when not 0, is the bulk action (RunBulk) this replay is part
	// of: its one audit row records the filter and the count, so the
	// replay writes none of its own.
	bulk int64
}

// ReplayTx replays dead letter id through the outbox, in tx: it locks the
// row (FOR UPDATE: a concurrent replay's transaction is waited for, and its
// outcome decides), queues its message with outbox.Add (its event id,
// metadata.EventID or else the message UUID, its payload and metadata, or
// the Edit's), moves the
// row out of the dead state (replayed, or superseded for an edit) and
// writes its audit row (ReplayCommand or EditReplayCommand, by opts.By;
// an edit's row carries EditChange, the diff with secrets masked),
// all in tx: committed, the relay publishes the message exactly once;
// rolled back, nothing happened. It is the one replay: Replay (the CLI's
// `millwright dlq replay`) and the operator console call it.
//
// The message carries metadata.DeadLetterReplayOf = id and, sent to its
// original topic, metadata.DeadLetterReplayFor = the consumer that gave up
// on it (ReplayTarget, or opts.For): every consumer group on the topic
// receives it, and the others ack it without running their handler.
//
// Errors: ErrNotFound (no such row), ErrNotDead (not dead and not
// forced, or taken by a concurrent replay that committed first: nothing
// queued), ErrNotReplayable, audit.ErrNotMigrated (the audit table is
// missing: every replay is audited), or the database's. After an error,
// roll tx back.
func ReplayTx(ctx context.Context, tx postgres.Tx, id int64, opts ReplayOneOptions) (ReplayItem, error) {
	if err := opts.By.Valid(); err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: ReplayTx: %w", err)
	}
	if err := validReplayFor(opts.For); err != nil {
		return ReplayItem{}, err
	}
	q, err := storage.FromTx(tx)
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: ReplayTx: %w", err)
	}
	if err := audit.Ready(ctx, tx); err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	force := opts.Force && opts.Edit == nil
	row, ok, err := storage.LockDeadLetterToReplay(ctx, q, id, force)
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: replaying dead letter %d%s: %w", id, storage.Hint(err), err)
	}
	if !ok {
		// Gone, or not dead (the lock waited for a concurrent replay and
		// read its outcome): which one.
		if _, err := storage.GetDeadLetter(ctx, q, id); storage.IsNoRows(err) {
			return ReplayItem{}, fmt.Errorf("dlq: dead letter %d: %w (see `millwright dlq list`)", id, ErrNotFound)
		} else if err != nil {
			return ReplayItem{}, fmt.Errorf("dlq: reading dead letter %d: %w", id, err)
		}
		return ReplayItem{}, fmt.Errorf("dlq: dead letter %d: %w", id, ErrNotDead)
	}
	d, err := deadLetter(row)
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	ev, item, err := replayEvent(d, opts)
	if err != nil {
		return ReplayItem{}, err
	}
	command, args := ReplayCommand, replayArgs(d, item, opts)
	switch {
	case opts.Edit != nil:
		command = EditReplayCommand
		err = storage.TakeDeadLetter(ctx, q, id, StateSuperseded, ev.ID, opts.By.User)
	case d.State == StateDead:
		err = storage.TakeDeadLetter(ctx, q, id, StateReplayed, "", opts.By.User)
	default: // forced: replayed or resolved before
		err = storage.MarkDeadLetterReplayed(ctx, q, id)
	}
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: marking dead letter %d replayed: %w", id, err)
	}
	if err := outbox.Add(ctx, tx, ev); err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: queueing dead letter %d through the outbox (run `millwright migrate` for the outbox tables if they are missing; nothing was changed): %w", id, err)
	}
	entry := opts.By.Entry(command, args, 1)
	if opts.Edit != nil {
		entry.Change = EditChange(d, *opts.Edit)
	}
	if opts.bulk != 0 {
		return item, nil
	}
	if _, err := audit.RecordTx(ctx, tx, entry); err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: auditing the replay of dead letter %d: %w", id, err)
	}
	return item, nil
}

// replayArgs are the audit row's arguments of a replay of d: what
// decided it, never the payload.
func replayArgs(d DeadLetter, item ReplayItem, opts ReplayOneOptions) []string {
	args := []string{"--id=" + strconv.FormatInt(d.ID, 10)}
	if item.To != d.OriginalTopic {
		args = append(args, "--target="+item.To)
	}
	if opts.For != "" {
		args = append(args, "--for="+opts.For)
	}
	if opts.Force && d.State != StateDead {
		args = append(args, "--force")
	}
	if opts.Edit != nil {
		args = append(args, fmt.Sprintf("--payload-bytes=%d", len(opts.Edit.Payload)))
		if opts.Edit.Metadata != nil {
			args = append(args, "--metadata-edited")
		}
	}
	return args
}

// replayEvent is the outbox event replaying d as opts says, and its
// report item.
func replayEvent(d DeadLetter, opts ReplayOneOptions) (outbox.Event, ReplayItem, error) {
	item := ReplayItem{ID: d.ID, MessageUUID: d.MessageUUID, From: d.OriginalTopic, To: opts.Target, Error: d.Error}
	if item.To == "" {
		item.To = d.OriginalTopic
	}
	if item.To == "" {
		return outbox.Event{}, item, fmt.Errorf("%w: dead letter %d has no original topic recorded: pass a target topic (`millwright dlq replay --id %d --target TOPIC`)", ErrNotReplayable, d.ID, d.ID)
	}
	item.For = d.replayFor(item.To, opts.For)
	// An edit form showed the metadata as text: an edit of a binary one
	// would send its text, not its bytes.
	if opts.Edit != nil && opts.Edit.Metadata != nil {
		if err := textOnly(d.ID, d.Metadata); err != nil {
			return outbox.Event{}, item, err
		}
	}
	md := maps.Clone(d.Metadata)
	if opts.Edit != nil && opts.Edit.Metadata != nil {
		md = maps.Clone(opts.Edit.Metadata)
	}
	if md == nil {
		md = map[string]string{}
	}
	md[metadata.DeadLetterReplayOf] = strconv.FormatInt(d.ID, 10)
	setReplayFor(md, item.For) // the other consumer groups on the topic ack it unrun
	id := md[metadata.EventID]
	if id == "" {
		id = d.MessageUUID
	}
	if !metadata.IsText(id) {
		id = "" // the outbox gives the replay an event id of its own
	}
	// The outbox stores text: a binary key or header travels packed, and
	// the relay publishes it byte for byte.
	md = metadata.PackBinary(md)
	payload := d.Payload
	if opts.Edit != nil {
		payload = opts.Edit.Payload
	}
	return outbox.Event{
		Topic: item.To, ID: id, Payload: payload, RawPayload: true, Metadata: md,
		AggregateType: md[metadata.AggregateType], AggregateID: md[metadata.AggregateID],
		EventType: md[metadata.EventType], Source: md[metadata.EventSource],
	}, item, nil
}

// textOnly refuses an edited replay of a dead letter whose stored
// metadata is not all text: the edit form showed it as text, so the edit
// would send other bytes than the original's.
func textOnly(rowID int64, md map[string]string) error {
	for _, k := range slices.Sorted(maps.Keys(md)) {
		if !metadata.IsText(k) || !metadata.IsText(md[k]) {
			return fmt.Errorf("%w: dead letter %d: metadata %q is not UTF-8 text (a binary key or header), and an edit of its metadata would send the text the form showed: replay it without editing the metadata (the bytes are kept), or republish it by hand (`millwright dlq show` prints its bytes)", ErrNotReplayable, rowID, k)
		}
	}
	return nil
}

// Replay replays the dead letters opts selects through the outbox, oldest
// first, each in its own transaction of db by ReplayTx (with its audit row
// by opts.By): committed, the relay publishes it exactly once. It is
// `millwright dlq replay`. A dry run (opts.DryRun) reports what would be
// queued where and changes nothing.
//
// The outbox tables (outbox.Migrations) must be in db's search_path, and a
// relay must run on them for the replays to reach the broker: Replay only
// queues. A row a concurrent replay (another run, the console) holds is
// waited for; one it took is skipped and counted (SkippedConcurrent).
// Replay stops at the first other error (a dead letter the outbox cannot
// carry, ErrNotReplayable, included: the dry run finds it first) and
// returns the report so far with it: every row reported was committed, so
// running the same replay again continues with the rest.
//
// Memory stays bounded whatever the backlog: rows are read 500 references
// at a time (id order, keyset paging) and each payload only inside its own
// transaction; the report keeps one small item per message.
func Replay(ctx context.Context, db postgres.DB, opts ReplayOptions) (ReplayReport, error) {
	pool, err := storage.FromDB(db)
	if err != nil {
		return ReplayReport{DryRun: opts.DryRun}, fmt.Errorf("dlq: Replay: %w", err)
	}
	return replay(ctx, pool, opts)
}

func replay(ctx context.Context, pool storage.Pool, opts ReplayOptions) (ReplayReport, error) {
	rep := ReplayReport{DryRun: opts.DryRun}
	if opts.Rate < 0 {
		return rep, fmt.Errorf("dlq: replay rate %v must be >= 0 (0 means unlimited)", opts.Rate)
	}
	if err := validReplayFor(opts.For); err != nil {
		return rep, err
	}
	if !opts.DryRun {
		if err := opts.By.Valid(); err != nil {
			return rep, fmt.Errorf("dlq: Replay: %w", err)
		}
	}
	if !opts.Force {
		skipped, err := countReplayed(ctx, pool, opts.Filter)
		if err != nil {
			return rep, err
		}
		rep.SkippedReplayed = skipped
	}
	r := &replayer{pool: pool, opts: opts, rep: &rep, next: time.Now()}
	if opts.Rate > 0 {
		r.interval = time.Duration(float64(time.Second) / opts.Rate)
	}
	err := r.run(ctx)
	return rep, err
}

// CountReplay returns how many rows a Replay with opts would handle now
// (the total of ReplayOptions.Progress): the rows the filter selects,
// without those already replayed unless opts.Force, at most Filter.Limit.
func CountReplay(ctx context.Context, db postgres.DB, opts ReplayOptions) (int, error) {
	pool, err := storage.FromDB(db)
	if err != nil {
		return 0, fmt.Errorf("dlq: CountReplay: %w", err)
	}
	f := opts.Filter
	f.Pending = !opts.Force
	n, err := count(ctx, pool, f)
	if err != nil {
		return 0, err
	}
	if f.Limit > 0 {
		n = min(n, f.Limit)
	}
	return n, nil
}

// countReplayed counts the rows f selects (without its limit) that were
// replayed before.
func countReplayed(ctx context.Context, q storage.Querier, f Filter) (int, error) {
	f.Pending, f.Limit = false, 0
	total, err := count(ctx, q, f)
	if err != nil {
		return 0, err
	}
	f.Pending = true
	pending, err := count(ctx, q, f)
	if err != nil {
		return 0, err
	}
	return total - pending, nil
}

// replayer is one Replay's state.
type replayer struct {
	pool     storage.Pool
	opts     ReplayOptions
	rep      *ReplayReport
	interval time.Duration
	next     time.Time
	handled  int
}

// run replays page after page. Keyset paging by id: memory holds one page
// of row references (not payloads: each row is read in its own
// transaction), however many dead letters the filter selects.
func (r *replayer) run(ctx context.Context) error {
	f := r.opts.Filter
	f.Pending = !r.opts.Force
	page := r.opts.page
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
		refs, err := listRefs(ctx, r.pool, pf)
		if err != nil {
			return err
		}
		for _, id := range refs {
			if err := r.handle(ctx, id); err != nil {
				return err
			}
		}
		if len(refs) < pf.Limit {
			return nil
		}
		f.afterID = refs[len(refs)-1]
		if remaining > 0 {
			if remaining -= len(refs); remaining == 0 {
				return nil
			}
		}
	}
}

// handle replays (or, in a dry run, lists) one row, paced by the rate.
func (r *replayer) handle(ctx context.Context, id int64) error {
	one := ReplayOneOptions{By: r.opts.By, Target: r.opts.Target, Force: r.opts.Force, For: r.opts.For}
	if r.opts.DryRun {
		d, err := get(ctx, r.pool, id)
		if errors.Is(err, ErrNotFound) {
			return nil // cleaned meanwhile
		}
		if err != nil {
			return err
		}
		_, item, err := replayEvent(d, one)
		if err != nil {
			return err
		}
		r.rep.Items = append(r.rep.Items, item)
		r.progress()
		return nil
	}
	if err := r.pace(ctx); err != nil {
		return err
	}
	item, err := r.replayOne(ctx, id, one)
	switch {
	case errors.Is(err, ErrNotDead), errors.Is(err, ErrNotFound):
		r.rep.SkippedConcurrent++
		r.progress()
		return nil
	case err != nil:
		return err
	}
	r.rep.Items = append(r.rep.Items, item)
	r.progress()
	return nil
}

// replayOne runs ReplayTx on row id in its own transaction.
func (r *replayer) replayOne(ctx context.Context, id int64, one ReplayOneOptions) (ReplayItem, error) {
	tx, err := r.pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	defer func() {
		// Bounded, and run even when ctx has ended (no-op after Commit).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	before, err := storage.DeadLetterReplayCount(ctx, tx, id)
	if storage.IsNoRows(err) {
		return ReplayItem{}, ErrNotFound
	}
	if err != nil {
		return ReplayItem{}, fmt.Errorf("dlq: replaying dead letter %d: %w", id, err)
	}
	item, err := ReplayTx(ctx, storage.TxOf(tx), id, one)
	if err != nil {
		return item, err
	}
	if err := tx.Commit(ctx); err != nil {
		if commitLanded(ctx, r.pool, tx, id, before) {
			// The commit was cut (an interrupt cancels ctx) after the
			// server applied it: the row is queued and marked, so count it.
			return item, nil
		}
		return item, fmt.Errorf("dlq: committing the replay of dead letter %d (nothing was queued if it failed; run the replay again): %w", id, err)
	}
	return item, nil
}

// pace waits for the next replay the rate allows.
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

// listRefs returns the ids of the rows f selects, by id.
func listRefs(ctx context.Context, q storage.Querier, f Filter) ([]int64, error) {
	refs, err := storage.ListDeadLetterRefs(ctx, q, f.selection())
	if err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters to replay (did `millwright migrate` run?): %w", err)
	}
	out := make([]int64, len(refs))
	for i, r := range refs {
		out[i] = r.ID
	}
	return out, nil
}

// commitLanded reports whether a commit that returned an error was applied
// anyway: row id's replay count is one past before. A cancelled context
// cuts the wait for the commit's answer, not the commit, so the outcome is
// read back on a fresh, bounded context, by a read that waits for the
// row's lock (the server ends the cut transaction one way or the other).
// Any doubt (the read fails) is false, which keeps the row counted as
// not replayed and the error reported.
func commitLanded(ctx context.Context, pool storage.Pool, tx storage.Tx, id int64, before int) bool {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// A commit never sent leaves the transaction, and its lock, open on
	// this connection: end it first (a no-op when the driver already did).
	_ = tx.Rollback(rctx)
	n, err := storage.DeadLetterReplayCount(rctx, pool, id)
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
