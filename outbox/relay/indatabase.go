package relay

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/tracing"
)

// moveRetry is how long the relay publishes through the publisher after
// the in-database path failed, before it tries that path again.
const moveRetry = 30 * time.Second

// errPlainMetadata: a claimed row's metadata is not an object of strings;
// the batch goes through the publisher, which reports the row.
var errPlainMetadata = errors.New("outbox relay: a claimed row's metadata is not a JSON object of strings")

// mover publishes batches in the database when the publisher writes to
// the outbox's own database (transport sql): the claim, the inserts into
// the topics' tables and the marks in one transaction, so a relay crash at
// any point neither loses nor duplicates an event. It is safe for
// concurrent use.
type mover struct {
	db  storage.Pool
	pub sqlschema.Publisher
	cfg *Config
	m   *metrics
	st  *relayStats
	tr  tracing.Config

	rates *laneRates // the relay's: the claim's shares by lane

	mu       sync.Mutex
	same     int // 0 not checked yet, 1 same database as the outbox's, -1 another
	offUntil time.Time

	// beforeCommit, when set (tests), runs in move after the inserts,
	// before the commit.
	beforeCommit func()
}

func newMover(db storage.Pool, pub sqlschema.Publisher, cfg *Config, m *metrics, st *relayStats, tr tracing.Config, rates *laneRates) *mover {
	return &mover{db: db, pub: pub, cfg: cfg, m: m, st: st, tr: tr, rates: rates}
}

// usable reports whether batches can be published in the database: the
// publisher writes to the outbox's own database. The check runs once;
// after an error, or a failed move (off), the publisher is used for
// moveRetry.
func (mv *mover) usable(ctx context.Context) bool {
	mv.mu.Lock()
	defer mv.mu.Unlock()
	if mv.same != 0 || time.Now().Before(mv.offUntil) {
		return mv.same > 0 && time.Now().After(mv.offUntil)
	}
	same, err := sameDatabase(ctx, mv.db, storage.NewSQL(mv.pub.DB()))
	switch {
	case err != nil:
		if ctx.Err() == nil {
			mv.cfg.Logger.Error("outbox relay: cannot tell whether the publisher writes to the outbox's database; publishing through it", err, watermill.LogFields{"retry_in": moveRetry})
			mv.offUntil = time.Now().Add(moveRetry)
		}
		return false
	case !same:
		mv.same = -1
		mv.cfg.Logger.Info("outbox relay: the publisher's database is not the outbox's; publishing through the publisher", nil)
		return false
	}
	mv.same = 1
	mv.cfg.Logger.Info("outbox relay: the publisher writes to the outbox's database; publishing in the database, in the transaction that marks rows published", nil)
	return true
}

// off makes the relay use the publisher for moveRetry.
func (mv *mover) off(err error) {
	mv.mu.Lock()
	mv.offUntil = time.Now().Add(moveRetry)
	mv.mu.Unlock()
	mv.cfg.Logger.Error("outbox relay: publishing in the database failed; publishing through the publisher for a while", err, watermill.LogFields{"retry_in": moveRetry})
}

// sameDatabase reports whether a and b reach the same database of the same
// running server: its name and oid, and the server's start time (to the
// microsecond, as epoch seconds so that the sessions' TimeZone does not
// matter), which a copy of the database (a restore, a branch, a promoted
// standby) does not share. Every role may read all three.
func sameDatabase(ctx context.Context, a, b storage.Querier) (bool, error) {
	ida, err := storage.DatabaseIdentity(ctx, a)
	if err != nil {
		return false, fmt.Errorf("identifying the outbox's database: %w", err)
	}
	idb, err := storage.DatabaseIdentity(ctx, b)
	if err != nil {
		return false, fmt.Errorf("identifying the publisher's database: %w", err)
	}
	return ida == idb, nil
}

// tryMove publishes one batch of the held lanes in the database when it
// can. ok false: the caller publishes through the publisher (the path is
// off, or the batch holds a row only the publisher path can report).
func (mv *mover) tryMove(ctx context.Context, held []int32) (n int, perLane map[int32]int, ok bool, err error) {
	if !mv.usable(ctx) {
		return 0, nil, false, nil
	}
	n, perLane, err = mv.move(ctx, held)
	// A batch with topics new to this relay: prepare them, outside the
	// transaction, and move again (a few times: the next batch may bring
	// other new topics).
	var up unpreparedTopics
	for range 3 {
		if !errors.As(err, &up) {
			break
		}
		if err = mv.prepareTopics(ctx, up); err == nil {
			n, perLane, err = mv.move(ctx, held)
		}
	}
	switch {
	case err == nil:
		return n, perLane, true, nil
	case ctx.Err() != nil:
		return 0, nil, true, err
	case !errors.Is(err, errPlainMetadata) && !errors.As(err, &up):
		mv.off(err)
	}
	return 0, nil, false, nil
}

// moved is what move reads of a claimed row.
type moved struct {
	topics  []string
	byTopic map[string][]int64
	plain   bool
	traced  []tracedRow
	n       int
	lanes   []row // lane and id of each row, in id order (for laneRates)
}

// move publishes one batch in the database: in one transaction it claims
// the rows, marking them published (storage.MoveClaim), and inserts them
// into their topics' tables in id order (one INSERT ... SELECT per topic,
// all in one Batch). It commits both or neither. On an error nothing was
// published (the transaction rolled back, or a failed commit took effect
// as a whole or not at all).
func (mv *mover) move(ctx context.Context, held []int32) (int, map[int32]int, error) {
	// The transaction bounds its statements and pauses by Lease: a relay
	// that stalls in it (paused, cut off) loses it. It commits without
	// waiting for the WAL flush (synchronous_commit off): a server crash
	// can undo the last moves, marks and messages together, and their rows
	// are published again; it cannot undo a move a consumer has
	// acknowledged in this database, since the consumer's own commit
	// flushes the WAL up to it. The settings go with BEGIN.
	tx, err := mv.db.Begin(ctx, storage.TxOptions{First: storage.MoveSettings(mv.cfg.Lease)})
	if err != nil {
		return 0, nil, fmt.Errorf("outbox relay: starting the in-database publish: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
	b, err := mv.claim(ctx, tx, held)
	if err != nil || b.n == 0 {
		return 0, nil, err
	}
	if !b.plain {
		return 0, nil, errPlainMetadata
	}
	var unprepared []string
	for _, topic := range b.topics {
		if !mv.prepared(topic) {
			unprepared = append(unprepared, topic)
		}
	}
	if len(unprepared) > 0 {
		// Tables are created on the publisher's pool, which may be this
		// one: not while this transaction holds a connection.
		return 0, nil, unpreparedTopics(unprepared)
	}
	overrides, end := traceMoved(mv.tr, b.traced)
	if err := mv.insert(ctx, tx, b, overrides); err != nil {
		end(err)
		return 0, nil, err
	}
	if mv.beforeCommit != nil {
		mv.beforeCommit()
	}
	if err := tx.Commit(ctx); err != nil {
		err = fmt.Errorf("outbox relay: committing %d event(s) published in the database: %w", b.n, err)
		end(err)
		return 0, nil, err
	}
	end(nil)
	mv.m.published.Add(float64(b.n))
	mv.st.published.Add(uint64(b.n))
	return b.n, perLane(b.lanes), nil
}

// claim runs storage.MoveClaim and groups the rows by topic; the claim's
// shares of the lanes are the relay's (laneRates), which learn from its
// rows.
func (mv *mover) claim(ctx context.Context, tx storage.Querier, held []int32) (moved, error) {
	shares := mv.rates.shares(mv.cfg.BatchSize, held)
	b, err := mv.claimShares(ctx, tx, held, shares)
	if err == nil {
		slices.SortFunc(b.lanes, func(x, y row) int { return cmp.Compare(x.id, y.id) })
		mv.rates.learn(mv.cfg.BatchSize, held, shares, b.lanes)
	}
	return b, err
}

// claimShares runs storage.MoveClaim with the shares given.
func (mv *mover) claimShares(ctx context.Context, tx storage.Querier, held, shares []int32) (moved, error) {
	b := moved{byTopic: map[string][]int64{}, plain: true}
	// Without a tracer that records, a row's span only matters for the
	// trace context it stored (the publisher path's span keeps it, or sets
	// none): rows without one are not traced.
	recording := mv.tr.Recording()
	err := storage.MoveClaim(ctx, tx, held, mv.cfg.BatchSize, shares, func(m storage.MovedRow) error {
		if _, seen := b.byTopic[m.Topic]; !seen {
			b.topics = append(b.topics, m.Topic)
		}
		b.byTopic[m.Topic] = append(b.byTopic[m.Topic], m.ID)
		b.lanes = append(b.lanes, row{lane: m.Lane, id: m.ID})
		b.plain = b.plain && m.Plain
		if m.TraceParent.Valid || recording {
			b.traced = append(b.traced, tracedRow{id: m.ID, topic: m.Topic, eventID: m.EventID, eventType: m.EventType, traceParent: m.TraceParent, traceState: m.TraceState})
		}
		b.n++
		return nil
	})
	if err != nil {
		return b, fmt.Errorf("outbox relay: claiming rows%s: %w", storage.Hint(err), err)
	}
	for _, ids := range b.byTopic {
		slices.Sort(ids)
	}
	return b, nil
}

// insert publishes the batch to its topics' tables: one INSERT ... SELECT
// per topic, all in one round trip (storage Batch).
func (mv *mover) insert(ctx context.Context, tx storage.Querier, b moved, overrides map[string][]storage.TraceOverride) error {
	ss := make([]storage.Statement, 0, len(b.topics))
	for _, topic := range b.topics {
		ids := b.byTopic[topic]
		table, err := mv.pub.Table(topic)
		if err != nil {
			return fmt.Errorf("outbox relay: publishing %d event(s) to %q in the database: %w", len(ids), topic, err)
		}
		s := storage.MoveInsert(table, ids, overrides[topic])
		s.What = fmt.Sprintf("publishing %d event(s) to %q in the database", len(ids), topic)
		ss = append(ss, s)
	}
	start := time.Now()
	if err := tx.Batch(ctx, ss...); err != nil {
		return fmt.Errorf("outbox relay: publishing %d event(s) in the database: %w", b.n, err)
	}
	mv.m.latency.Observe(time.Since(start).Seconds())
	return nil
}

// unpreparedTopics: a claimed batch has topics the publisher has not
// prepared for this relay yet (see prepareTopics).
type unpreparedTopics []string

var _ error = unpreparedTopics(nil)

func (u unpreparedTopics) Error() string {
	return fmt.Sprintf("outbox relay: topics %q not prepared for publishing in the database", []string(u))
}

// prepared reports whether topic's storage is prepared, by this relay or
// by another through the same publisher: the publisher's Table tells,
// without I/O. A relay that starts beside others on a topic they already
// publish so moves its first batch at once, instead of claiming it,
// rolling the claim back and preparing the topic first.
func (mv *mover) prepared(topic string) bool {
	_, err := mv.pub.Table(topic)
	return err == nil
}

// prepareTopics has the publisher create the topics' storage, outside any
// transaction of the relay's.
func (mv *mover) prepareTopics(ctx context.Context, topics []string) error {
	for _, topic := range topics {
		if err := mv.pub.PrepareTopic(ctx, topic); err != nil {
			return fmt.Errorf("outbox relay: preparing topic %q for publishing in the database: %w", topic, err)
		}
	}
	return nil
}

// tracedRow is what the relay's span of a claimed row needs.
type tracedRow struct {
	id                        int64
	topic, eventID, eventType string
	traceParent, traceState   sql.NullString
}

// traceMoved starts the relay's span of each row, as the publisher path
// does (tracing.RelayPublish: a child of the stored trace context, if any,
// with the same attributes), and returns, per topic, the rows whose trace
// context the span changes with the metadata to merge, and the function
// that ends the spans. With no tracer installed a span
// keeps the stored context (or none) and nothing is overridden.
func traceMoved(tr tracing.Config, rows []tracedRow) (overrides map[string][]storage.TraceOverride, end func(error)) {
	if len(rows) == 0 {
		return nil, func(error) {}
	}
	ends := make([]func(error), 0, len(rows))
	overrides = map[string][]storage.TraceOverride{}
	for _, rw := range rows {
		msg := message.NewMessage(rw.eventID, nil)
		msg.Metadata.Set(metadata.EventID, rw.eventID)
		if rw.eventType != "" {
			msg.Metadata.Set(metadata.EventType, rw.eventType)
		}
		if rw.traceParent.Valid {
			msg.Metadata.Set(metadata.TraceParent, rw.traceParent.String)
		}
		if rw.traceState.Valid {
			msg.Metadata.Set(metadata.TraceState, rw.traceState.String)
		}
		ends = append(ends, tr.RelayPublish(rw.topic, msg))
		tp, ts := msg.Metadata.Get(metadata.TraceParent), msg.Metadata.Get(metadata.TraceState)
		if tp == rw.traceParent.String && ts == rw.traceState.String {
			continue
		}
		meta := map[string]string{metadata.TraceParent: tp}
		if ts != "" {
			meta[metadata.TraceState] = ts
		}
		overrides[rw.topic] = append(overrides[rw.topic], storage.TraceOverride{ID: rw.id, Meta: meta})
	}
	return overrides, func(err error) {
		for _, e := range ends {
			e(err)
		}
	}
}
