package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/tracing"
)

// inDatabasePublisher has the method set of transport.InDatabasePublisher
// (declared here for the reason batchPublisher is).
type inDatabasePublisher interface {
	DB() *sql.DB
	PrepareTopic(ctx context.Context, topic string) error
	InsertSelect(topic, query string) (string, error)
}

// moveSQL is the claim of the in-database path: the rows claimCTE finds are
// marked published at once, in the transaction that also inserts them into
// their topics' tables (move). It returns each row's id and topic, and
// whether its metadata is a JSON object of strings (every row Add wrote);
// a hand-written row with other metadata goes through the publisher,
// which reports it (see rowMessage). It also returns what the relay's span
// of each row needs (see traceMoved).
const moveSQL = claimCTE + `
UPDATE millwright_outbox t
SET status = 'published', published_at = now()
WHERE t.id = ANY(ARRAY(SELECT id FROM claimed)) AND t.status = 'pending'
RETURNING t.id, t.topic, jsonb_typeof(t.metadata) = 'object' AND NOT EXISTS (
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
// jsonb functions (4.3 -> 1.8 ms per 500 rows under EXPLAIN ANALYZE);
// other rows take the jsonb path, whose || gives the override.
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
	return `SELECT o.event_id AS uuid,
	COALESCE(convert_to(o.payload::text, 'UTF8'), o.payload_raw) AS payload,
	CASE WHEN NOT ` + meta + ` ?| ARRAY[` + strings.Join(keys, ", ") + `] THEN ` + text + `
	ELSE ` + merged + ` END AS metadata,
	o.id AS position` + from
}

// moveRetry is how long the relay publishes through the publisher after
// the in-database path failed, before it tries that path again.
const moveRetry = 30 * time.Second

// errPlainMetadata: a claimed row's metadata is not an object of strings;
// the batch goes through the publisher, which reports the row.
var errPlainMetadata = errors.New("outbox relay: a claimed row's metadata is not a JSON object of strings")

// canMove reports whether batches can be published in the database: the
// publisher is an in-database one (transport sql) and writes to the
// outbox's own database. The check runs once; after an error, or a failed
// move (moveOff), the publisher is used for moveRetry.
func (r *Relay) canMove(ctx context.Context) bool {
	if r.inDB == nil {
		return false
	}
	r.moveMu.Lock()
	defer r.moveMu.Unlock()
	if r.moveSame != 0 || time.Now().Before(r.moveOffUntil) {
		return r.moveSame > 0 && time.Now().After(r.moveOffUntil)
	}
	same, err := sameDatabase(ctx, r.db, r.inDB.DB())
	switch {
	case err != nil:
		if ctx.Err() == nil {
			r.cfg.Logger.Error("outbox relay: cannot tell whether the publisher writes to the outbox's database; publishing through it", err, watermill.LogFields{"retry_in": moveRetry})
			r.moveOffUntil = time.Now().Add(moveRetry)
		}
		return false
	case !same:
		r.moveSame = -1
		r.cfg.Logger.Info("outbox relay: the publisher's database is not the outbox's; publishing through the publisher", nil)
		return false
	}
	r.moveSame = 1
	r.cfg.Logger.Info("outbox relay: the publisher writes to the outbox's database; publishing in the database, in the transaction that marks rows published", nil)
	return true
}

// moveOff makes the relay use the publisher for moveRetry.
func (r *Relay) moveOff(err error) {
	r.moveMu.Lock()
	r.moveOffUntil = time.Now().Add(moveRetry)
	r.moveMu.Unlock()
	r.cfg.Logger.Error("outbox relay: publishing in the database failed; publishing through the publisher for a while", err, watermill.LogFields{"retry_in": moveRetry})
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

// move publishes one batch in the database: in one transaction it claims
// the rows, marking them published (moveSQL), and inserts them into their
// topics' tables in id order (one INSERT ... SELECT per topic). It commits
// both or neither, so a relay crash at any point neither loses nor
// duplicates an event; the open transaction, not next_attempt_at, is the
// rows' lease. It returns the number of rows published. On an error
// nothing was published (the transaction rolled back, or a failed commit
// took effect as a whole or not at all): the caller publishes through the
// publisher instead.
//
// Rows another relay is moving stay due and pending to this one until that
// relay commits, so a claim can find nothing while heads are due: held
// reports that case (heldSQL: a due head among the first rows, which the
// claim skipped because it is locked), and the caller looks again soon
// rather than after PollInterval.
func (r *Relay) move(ctx context.Context) (n int, held bool, err error) {
	stmt, err := r.prepare(ctx, &r.moveStmt, moveSQL)
	if err != nil {
		return 0, false, err
	}
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, false, fmt.Errorf("outbox relay: starting the in-database publish: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op
	// The transaction is the batch's lease: a relay that stalls in it
	// (paused, cut off) loses it, and its rows, after Lease. It commits
	// without waiting for the WAL flush (synchronous_commit off, 8-14%
	// more events/s): a server crash can undo the last moves, marks and
	// messages together, and their rows are published again; it cannot
	// undo a move a consumer has acknowledged in this database, since the
	// consumer's own commit flushes the WAL up to it.
	if _, err := tx.ExecContext(ctx, r.moveLeaseSQL); err != nil {
		return 0, false, fmt.Errorf("outbox relay: starting the in-database publish: %w", err)
	}
	rows, err := tx.StmtContext(ctx, stmt).QueryContext(ctx, r.cfg.BatchSize, windowFactor*r.cfg.BatchSize)
	if err != nil {
		return 0, false, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	var (
		topics  []string
		byTopic = map[string][]int64{}
		plain   = true
		traced  []tracedRow
		// Without a tracer that records, a row's span only matters for
		// the trace context it stored (the publisher path's span keeps
		// it, or sets none): rows without one are not traced.
		recording = tracing.Recording()
	)
	for rows.Next() {
		var (
			id         int64
			topic      string
			ok         bool
			eventID    string
			eventType  string
			tp, tstate sql.NullString
		)
		if err := rows.Scan(&id, &topic, &ok, &eventID, &eventType, &tp, &tstate); err != nil {
			rows.Close()
			return 0, false, fmt.Errorf("outbox relay: reading claimed row: %w", err)
		}
		if _, seen := byTopic[topic]; !seen {
			topics = append(topics, topic)
		}
		byTopic[topic] = append(byTopic[topic], id)
		plain = plain && ok
		if tp.Valid || recording {
			traced = append(traced, tracedRow{id: id, topic: topic, eventID: eventID, eventType: eventType, traceParent: tp, traceState: tstate})
		}
		n++
	}
	if err := rows.Err(); err != nil {
		return 0, false, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	if n == 0 {
		err := tx.QueryRowContext(ctx, heldSQL, windowFactor*r.cfg.BatchSize).Scan(&held)
		if err != nil {
			return 0, false, fmt.Errorf("outbox relay: looking for held rows: %w", err)
		}
		return 0, held, nil
	}
	if !plain {
		return 0, false, errPlainMetadata
	}
	var unprepared []string
	for _, topic := range topics {
		if !r.prepared(topic) {
			unprepared = append(unprepared, topic)
		}
	}
	if len(unprepared) > 0 {
		// Tables are created on the publisher's pool, which may be this
		// one: not while this transaction holds a connection.
		return 0, false, unpreparedTopics(unprepared)
	}
	overrides, end := traceMoved(traced)
	fail := func(err error) (int, bool, error) {
		end(err)
		return 0, false, err
	}
	for _, topic := range topics {
		ids := byTopic[topic]
		query := moveSelect(false) + idArray(ids) + `)`
		if o := overrides[topic]; o != "" {
			query = moveSelect(true) + o + ` tr(id, meta) ON tr.id = o.id
WHERE o.id = ANY(` + idArray(ids) + `)`
		}
		q, err := r.inDB.InsertSelect(topic, query)
		if err != nil {
			return fail(fmt.Errorf("outbox relay: publishing %d event(s) to %q in the database: %w", len(ids), topic, err))
		}
		start := time.Now()
		if _, err := tx.ExecContext(ctx, q); err != nil {
			return fail(fmt.Errorf("outbox relay: publishing %d event(s) to %q in the database: %w", len(ids), topic, err))
		}
		r.m.latency.Observe(time.Since(start).Seconds())
	}
	if r.beforeMoveCommit != nil {
		r.beforeMoveCommit()
	}
	if err := tx.Commit(); err != nil {
		return fail(fmt.Errorf("outbox relay: committing %d event(s) published in the database: %w", n, err))
	}
	end(nil)
	r.m.published.Add(float64(n))
	r.stats.published.Add(uint64(n))
	return n, false, nil
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
func traceMoved(rows []tracedRow) (overrides map[string]string, end func(error)) {
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
		ends = append(ends, tracing.RelayPublish(rw.topic, msg))
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

// help publishes in the database beside Run's loop while the backlog is
// deep: Run starts it when a batch moved full, and it stops at the first
// batch that is not (or on Close, after its batch). One relay then keeps
// two of the database's connections, and cores, busy rather than one (a
// move is all database work: claim, insert, commit); with several relays
// their batches soon come back partial or held, and helpers stop rather
// than crowd one another out of the claim's window.
func (r *Relay) help(ctx context.Context) (alone bool) {
	for {
		select {
		case <-ctx.Done():
			return true
		case <-r.closing:
			return true
		default:
		}
		if !r.canMove(ctx) { // moveOff: Run's loop uses the publisher for a while
			return true
		}
		n, held, err := r.move(ctx)
		r.stats.endRound(0, err)
		if err != nil {
			// Run's own loop handles it (new topics, the publisher
			// path); the helper just stops.
			if ctx.Err() == nil && !errors.Is(err, errPlainMetadata) && !errors.As(err, new(unpreparedTopics)) {
				r.cfg.Logger.Error("outbox relay: in-database publish beside the relay's loop failed", err, nil)
			}
			return false
		}
		if held || n < r.cfg.BatchSize {
			return n == 0 && !held
		}
	}
}

// unpreparedTopics: a claimed batch has topics the publisher has not
// prepared for this relay yet (see prepareTopics).
type unpreparedTopics []string

func (u unpreparedTopics) Error() string {
	return fmt.Sprintf("outbox relay: topics %q not prepared for publishing in the database", []string(u))
}

// prepared reports whether topic's storage was prepared by this relay.
func (r *Relay) prepared(topic string) bool {
	r.moveMu.Lock()
	defer r.moveMu.Unlock()
	_, ok := r.movable[topic]
	return ok
}

// prepareTopics has the publisher create the topics' storage, outside any
// transaction of the relay's.
func (r *Relay) prepareTopics(ctx context.Context, topics []string) error {
	for _, topic := range topics {
		if err := r.inDB.PrepareTopic(ctx, topic); err != nil {
			return fmt.Errorf("outbox relay: preparing topic %q for publishing in the database: %w", topic, err)
		}
		r.moveMu.Lock()
		if r.movable == nil {
			r.movable = map[string]struct{}{}
		}
		r.movable[topic] = struct{}{}
		r.moveMu.Unlock()
	}
	return nil
}

// heldSQL: is any of the first $1 pending rows a due head (the oldest
// pending row of its aggregate)? After a claim that took nothing, such a
// head is locked by another relay's claim. Rows that arrived behind a head
// that is backing off are due but are not heads: they do not count.
// Bounded by $1, unlike a look for any due head, which could walk a long
// backlog of rows backing off.
const heldSQL = `SELECT EXISTS (SELECT 1 FROM (
	SELECT o.id, o.aggregate_type, o.aggregate_id, o.next_attempt_at FROM millwright_outbox o
	WHERE o.status = 'pending' ORDER BY o.id LIMIT $1) c
	WHERE c.next_attempt_at <= now() AND ` + isHead + `)`

// take publishes one batch in the database when it can (moved: the number
// of rows published; held: see move) and otherwise claims rows for the
// publisher.
func (r *Relay) take(ctx context.Context) (rows []row, moved int, held bool, err error) {
	if r.canMove(ctx) {
		moved, held, err = r.move(ctx)
		// A batch with topics new to this relay: prepare them, outside
		// the transaction, and move again (a few times: the next batch
		// may bring other new topics).
		var up unpreparedTopics
		for range 3 {
			if !errors.As(err, &up) {
				break
			}
			if err = r.prepareTopics(ctx, up); err == nil {
				moved, held, err = r.move(ctx)
			}
		}
		switch {
		case err == nil:
			return nil, moved, held, nil
		case ctx.Err() != nil:
			return nil, 0, false, err
		case !errors.Is(err, errPlainMetadata) && !errors.As(err, &up):
			r.moveOff(err)
		}
	}
	rows, err = r.claim(ctx)
	return rows, 0, false, err
}
