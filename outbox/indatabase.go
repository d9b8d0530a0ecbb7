package outbox

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/tracing"
)

// moveSQL is the claim of the in-database path: the rows claimedCTE finds
// are marked published at once, in the transaction that also inserts them
// into their topics' tables (mover.move). It returns each row's id, lane
// (for the claim's shares and for lending) and topic, and
// whether its metadata is a JSON object of strings (every row Add wrote);
// a hand-written row with other metadata goes through the publisher,
// which reports it (see rowMessage). It also returns what the relay's span
// of each row needs (see traceMoved).
var moveSQL = claimedCTE + `
UPDATE millwright_outbox t
SET status = 'published', published_at = now()
WHERE t.id = ANY(ARRAY(SELECT id FROM claimed)) AND t.status = 'pending'
RETURNING t.id, ` + laneExpr + `, t.topic, jsonb_typeof(t.metadata) = 'object' AND NOT EXISTS (
	SELECT 1 FROM jsonb_each(t.metadata) e WHERE jsonb_typeof(e.value) <> 'string'),
	t.event_id, t.event_type, t.metadata->>'` + metadata.TraceParent + `', t.metadata->>'` + metadata.TraceState + `'`

// moveSelect selects claimed rows as the messages the publisher path would
// send: the metadata derivedMetadata gives, overridden by the metadata
// column, and metadata.EventID from event_id; the payload as rowMessage
// reads it. TestInDatabasePublishSendsWhatThePublisherSends holds the two
// paths together. moveSelect(false) ends with "o.id = ANY(", for a
// bigint[] literal of the ids and ")"; moveSelect(true) reads the metadata
// column overridden by tr.meta (the trace context of the relay's span) and
// ends with "FROM millwright_outbox o LEFT JOIN", for "(VALUES (id,
// meta), ...) tr(id, meta) ON tr.id = o.id WHERE o.id = ANY(...)".
//
// The metadata is written as JSON text when the metadata column names
// none of the derived keys (every row Add writes: it stores only what the
// columns do not say), which costs less than half of building it with
// jsonb functions (compare the two under EXPLAIN ANALYZE); other rows take
// the jsonb path, whose || gives the override.
var moveSelects = [2]string{moveSelectFor(false), moveSelectFor(true)}

func moveSelect(traced bool) string {
	if traced {
		return moveSelects[1]
	}
	return moveSelects[0]
}

func moveSelectFor(traced bool) string {
	meta := `o.metadata`
	if traced {
		meta = `(o.metadata || COALESCE(tr.meta, '{}'::jsonb))`
	}
	lit := pq.QuoteLiteral
	key := func(k string) string { // a JSON object key, as an SQL literal's text
		b, _ := json.Marshal(k)
		return string(b)
	}
	str := func(expr string) string { return `to_json(` + expr + `)::text` }
	ts := `(o.created_at AT TIME ZONE 'UTC')`
	// RFC 3339 in UTC, fraction without trailing zeros, as Go's
	// time.RFC3339Nano (to_json writes timestamps in ISO 8601 whatever
	// DateStyle is).
	rfc3339 := `(to_json(` + ts + `) #>> '{}') || 'Z'`
	orderingKey := `CASE WHEN o.aggregate_type = '' THEN o.aggregate_id ELSE o.aggregate_type || '/' || o.aggregate_id END`
	derivedKeys := []string{metadata.EventID, metadata.EventSpecVersion, metadata.EventTime, metadata.EventSubject,
		metadata.AggregateID, metadata.OrderingKey, metadata.AggregateType, metadata.EventType, metadata.EventDataContentType}
	keys := make([]string, len(derivedKeys))
	for i, k := range derivedKeys {
		keys[i] = lit(k)
	}
	text := `('{` + key(metadata.EventID) + `:' || ` + str(`o.event_id`) +
		` || ',` + key(metadata.EventSpecVersion) + `:"1.0",` + key(metadata.EventTime) + `:"' || ` + rfc3339 + ` || '"'
		|| CASE WHEN o.aggregate_id = '' THEN '' ELSE ',` + key(metadata.EventSubject) + `:' || ` + str(`o.aggregate_id`) +
		` || ',` + key(metadata.AggregateID) + `:' || ` + str(`o.aggregate_id`) +
		` || ',` + key(metadata.OrderingKey) + `:' || ` + str(orderingKey) + ` END
		|| CASE WHEN o.aggregate_type = '' THEN '' ELSE ',` + key(metadata.AggregateType) + `:' || ` + str(`o.aggregate_type`) + ` END
		|| CASE WHEN o.event_type = '' THEN '' ELSE ',` + key(metadata.EventType) + `:' || ` + str(`o.event_type`) + ` END
		|| CASE WHEN o.payload IS NULL THEN '' ELSE ',` + key(metadata.EventDataContentType) + `:"application/json"' END
		|| CASE WHEN ` + meta + ` = '{}' THEN '' ELSE ',' || substr(` + meta + `::text, 2, length(` + meta + `::text) - 2) END
		|| '}')::json`
	merged := `(jsonb_strip_nulls(jsonb_build_object(
			` + lit(metadata.EventID) + `, o.event_id,
			` + lit(metadata.EventSpecVersion) + `, '1.0',
			` + lit(metadata.EventTime) + `, ` + rfc3339 + `,
			` + lit(metadata.EventSubject) + `, NULLIF(o.aggregate_id, ''),
			` + lit(metadata.AggregateID) + `, NULLIF(o.aggregate_id, ''),
			` + lit(metadata.OrderingKey) + `, CASE WHEN o.aggregate_id <> '' THEN ` + orderingKey + ` END,
			` + lit(metadata.AggregateType) + `, NULLIF(o.aggregate_type, ''),
			` + lit(metadata.EventType) + `, NULLIF(o.event_type, ''),
			` + lit(metadata.EventDataContentType) + `, CASE WHEN o.payload IS NOT NULL THEN 'application/json' END))
		 || ` + meta + ` || jsonb_build_object(` + lit(metadata.EventID) + `, o.event_id)
		 || CASE WHEN o.aggregate_id <> '' AND ` + meta + `->>` + lit(metadata.OrderingKey) + ` = '' THEN
			jsonb_build_object(` + lit(metadata.OrderingKey) + `, ` + orderingKey + `) ELSE '{}' END)::json`
	from := `
FROM millwright_outbox o
WHERE o.id = ANY(`
	if traced {
		from = `
FROM millwright_outbox o LEFT JOIN `
	}
	return `SELECT o.event_id AS ` + sqlschema.ColUUID + `,
	COALESCE(convert_to(o.payload::text, 'UTF8'), o.payload_raw) AS ` + sqlschema.ColPayload + `,
	CASE WHEN NOT ` + meta + ` ?| ARRAY[` + strings.Join(keys, ", ") + `] THEN ` + text + `
	ELSE ` + merged + ` END AS ` + sqlschema.ColMetadata + `,
	o.id AS ` + sqlschema.ColPosition + from
}

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
	db  *sql.DB
	pub sqlschema.Publisher
	cfg *RelayConfig
	m   *metrics
	st  *relayStats
	tr  tracing.Config

	claimStmt preparedStmt // moveSQL
	rates     *laneRates   // the relay's: the claim's shares by lane

	mu       sync.Mutex
	same     int // 0 not checked yet, 1 same database as the outbox's, -1 another
	offUntil time.Time
	txSQL    string // the transaction's settings (see move)

	// beforeCommit, when set (tests), runs in move after the inserts,
	// before the commit.
	beforeCommit func()
}

func newMover(db *sql.DB, pub sqlschema.Publisher, cfg *RelayConfig, m *metrics, st *relayStats, tr tracing.Config, rates *laneRates) *mover {
	ms := strconv.FormatInt(cfg.Lease.Milliseconds(), 10)
	return &mover{db: db, pub: pub, cfg: cfg, m: m, st: st, tr: tr, rates: rates,
		claimStmt: preparedStmt{db: db, query: moveSQL, what: "the in-database claim"},
		txSQL: "SET LOCAL statement_timeout = " + ms + "; SET LOCAL idle_in_transaction_session_timeout = " + ms +
			"; SET LOCAL synchronous_commit = off"}
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
	same, err := sameDatabase(ctx, mv.db, mv.pub.DB())
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
func sameDatabase(ctx context.Context, a, b *sql.DB) (bool, error) {
	const q = `SELECT current_database() || '/' || d.oid::text || '/' || extract(epoch FROM pg_postmaster_start_time())::text
		FROM pg_database d WHERE d.datname = current_database()`
	var ida, idb string
	if err := a.QueryRowContext(ctx, q).Scan(&ida); err != nil {
		return false, fmt.Errorf("identifying the outbox's database: %w", err)
	}
	if err := b.QueryRowContext(ctx, q).Scan(&idb); err != nil {
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
// the rows, marking them published (moveSQL), and inserts them into their
// topics' tables in id order (one INSERT ... SELECT per topic). It commits
// both or neither. On an error nothing was published (the transaction
// rolled back, or a failed commit took effect as a whole or not at all).
func (mv *mover) move(ctx context.Context, held []int32) (int, map[int32]int, error) {
	stmt, err := mv.claimStmt.get(ctx)
	if err != nil {
		return 0, nil, err
	}
	tx, err := mv.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, nil, fmt.Errorf("outbox relay: starting the in-database publish: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op
	// The transaction bounds its statements and pauses by Lease: a relay
	// that stalls in it (paused, cut off) loses it. It commits without
	// waiting for the WAL flush (synchronous_commit off): a server crash
	// can undo the last moves, marks and messages together, and their rows
	// are published again; it cannot undo a move a consumer has
	// acknowledged in this database, since the consumer's own commit
	// flushes the WAL up to it.
	if _, err := tx.ExecContext(ctx, mv.txSQL); err != nil {
		return 0, nil, fmt.Errorf("outbox relay: starting the in-database publish: %w", err)
	}
	b, err := mv.claim(ctx, tx.StmtContext(ctx, stmt), held)
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
	if err := tx.Commit(); err != nil {
		err = fmt.Errorf("outbox relay: committing %d event(s) published in the database: %w", b.n, err)
		end(err)
		return 0, nil, err
	}
	end(nil)
	mv.m.published.Add(float64(b.n))
	mv.st.published.Add(uint64(b.n))
	return b.n, perLane(b.lanes), nil
}

// claim runs moveSQL and groups the rows by topic; the claim's shares of
// the lanes are the relay's (laneRates), which learn from its rows.
func (mv *mover) claim(ctx context.Context, stmt *sql.Stmt, held []int32) (moved, error) {
	shares := mv.rates.shares(mv.cfg.BatchSize, held)
	b, err := mv.claimShares(ctx, stmt, held, shares)
	if err == nil {
		slices.SortFunc(b.lanes, func(x, y row) int { return cmp.Compare(x.id, y.id) })
		mv.rates.learn(mv.cfg.BatchSize, held, shares, b.lanes)
	}
	return b, err
}

// claimShares runs moveSQL with the shares given.
func (mv *mover) claimShares(ctx context.Context, stmt *sql.Stmt, held, shares []int32) (moved, error) {
	b := moved{byTopic: map[string][]int64{}, plain: true}
	rows, err := stmt.QueryContext(ctx, intArrayParam(held), mv.cfg.BatchSize, intArrayParam(shares))
	if err != nil {
		return b, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	defer rows.Close()
	// Without a tracer that records, a row's span only matters for the
	// trace context it stored (the publisher path's span keeps it, or sets
	// none): rows without one are not traced.
	recording := mv.tr.Recording()
	for rows.Next() {
		var (
			id                 int64
			lane               int32
			topic              string
			ok                 bool
			eventID, eventType string
			tp, tstate         sql.NullString
		)
		if err := rows.Scan(&id, &lane, &topic, &ok, &eventID, &eventType, &tp, &tstate); err != nil {
			return b, fmt.Errorf("outbox relay: reading claimed row: %w", err)
		}
		if _, seen := b.byTopic[topic]; !seen {
			b.topics = append(b.topics, topic)
		}
		b.byTopic[topic] = append(b.byTopic[topic], id)
		b.lanes = append(b.lanes, row{lane: lane, id: id})
		b.plain = b.plain && ok
		if tp.Valid || recording {
			b.traced = append(b.traced, tracedRow{id: id, topic: topic, eventID: eventID, eventType: eventType, traceParent: tp, traceState: tstate})
		}
		b.n++
	}
	if err := rows.Err(); err != nil {
		return b, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	for _, ids := range b.byTopic {
		slices.Sort(ids)
	}
	return b, nil
}

// insert runs one INSERT ... SELECT per topic of the batch.
func (mv *mover) insert(ctx context.Context, tx *sql.Tx, b moved, overrides map[string]string) error {
	for _, topic := range b.topics {
		ids := b.byTopic[topic]
		query := moveSelect(false) + idArray(ids) + `)`
		if o := overrides[topic]; o != "" {
			query = moveSelect(true) + o + ` tr(id, meta) ON tr.id = o.id
WHERE o.id = ANY(` + idArray(ids) + `)`
		}
		table, err := mv.pub.Table(topic)
		if err != nil {
			return fmt.Errorf("outbox relay: publishing %d event(s) to %q in the database: %w", len(ids), topic, err)
		}
		start := time.Now()
		if _, err := tx.ExecContext(ctx, sqlschema.InsertSelect(table, query)); err != nil {
			return fmt.Errorf("outbox relay: publishing %d event(s) to %q in the database: %w", len(ids), topic, err)
		}
		mv.m.latency.Observe(time.Since(start).Seconds())
	}
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
// context the span changes as a VALUES list of (id, metadata to merge),
// and the function that ends the spans. With no tracer installed a span
// keeps the stored context (or none) and nothing is overridden.
func traceMoved(tr tracing.Config, rows []tracedRow) (overrides map[string]string, end func(error)) {
	if len(rows) == 0 {
		return nil, func(error) {}
	}
	ends := make([]func(error), 0, len(rows))
	lists := map[string]*strings.Builder{}
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
		js, _ := json.Marshal(meta)
		b := lists[rw.topic]
		if b == nil {
			b = &strings.Builder{}
			b.WriteString("(VALUES ")
			lists[rw.topic] = b
		} else {
			b.WriteString(", ")
		}
		fmt.Fprintf(b, "(%d::bigint, %s::jsonb)", rw.id, pq.QuoteLiteral(string(js)))
	}
	overrides = make(map[string]string, len(lists))
	for topic, b := range lists {
		overrides[topic] = b.String() + ")"
	}
	return overrides, func(err error) {
		for _, e := range ends {
			e(err)
		}
	}
}
