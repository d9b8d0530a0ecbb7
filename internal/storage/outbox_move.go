package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/metadata"
)

// The relay's in-database publishing (the sql transport on the outbox's
// own database): in one transaction, the claim marks the rows published
// (MoveClaim) and one INSERT ... SELECT per topic copies them into the
// topics' tables (MoveInsert).

// moveClaimSQL is the claim of the in-database path: the rows
// outboxClaimedCTE finds are marked published at once. It returns each
// row's id, lane and topic, whether its metadata is a JSON object of
// strings (every row Add wrote), and what the relay's span of each row
// needs.
var moveClaimSQL = outboxClaimedCTE + `
UPDATE millwright_outbox t
SET status = 'published', published_at = now()
WHERE t.id = ANY(ARRAY(SELECT id FROM claimed)) AND t.status = 'pending'
RETURNING t.id, ` + OutboxLaneExpr + `, t.topic, jsonb_typeof(t.metadata) = 'object' AND NOT EXISTS (
	SELECT 1 FROM jsonb_each(t.metadata) e WHERE jsonb_typeof(e.value) <> 'string'),
	t.event_id, t.event_type, t.metadata->>'` + metadata.TraceParent + `', t.metadata->>'` + metadata.TraceState + `'`

// MovedRow is one row of MoveClaim.
type MovedRow struct {
	ID                      int64
	Lane                    int32
	Topic                   string
	Plain                   bool // its metadata is a JSON object of strings
	EventID, EventType      string
	TraceParent, TraceState sql.NullString
}

// MoveClaim claims, as ClaimEvents, and marks published at once, at most
// batch due rows of the lanes, in q (the in-database publish's
// transaction), calling each for every row.
func MoveClaim(ctx context.Context, q Querier, lanes []int32, batch int, shares []int32, each func(MovedRow) error) error {
	s := Statement{SQL: moveClaimSQL, Args: []any{int64s(lanes), batch, int64s(shares)}, Expect: NoExpect, What: "the in-database claim"}
	return q.Query(ctx, s, func(r Row) error {
		var m MovedRow
		var lane int64
		if err := r.Scan(&m.ID, &lane, &m.Topic, &m.Plain, &m.EventID, &m.EventType, &m.TraceParent, &m.TraceState); err != nil {
			return err
		}
		m.Lane = int32(lane)
		return each(m)
	})
}

// MoveSettings are the first statements of the in-database publish's
// transaction (TxOptions.First): lease bounds its statements and pauses,
// and it commits without waiting for the WAL flush.
func MoveSettings(lease time.Duration) []Statement {
	ms := strconv.FormatInt(lease.Milliseconds(), 10)
	return []Statement{S("SET LOCAL statement_timeout = " + ms + "; SET LOCAL idle_in_transaction_session_timeout = " + ms +
		"; SET LOCAL synchronous_commit = off")}
}

// TraceOverride is the metadata (a JSON object of strings) merged into a
// moved row's: the trace context of the relay's span.
type TraceOverride struct {
	ID   int64
	Meta map[string]string
}

// MoveInsert is the statement that publishes rows ids (all of one topic)
// into table (Publisher.Table) as the messages the publisher path would
// send, with the overrides merged into their metadata.
func MoveInsert(table string, ids []int64, overrides []TraceOverride) Statement {
	if len(overrides) == 0 {
		return Statement{SQL: sqlschema.InsertSelect(table, moveSelects[0]), Args: []any{ids}, Expect: NoExpect, What: "publishing in the database"}
	}
	oids := make([]int64, len(overrides))
	metas := make([]string, len(overrides))
	for i, o := range overrides {
		js, _ := json.Marshal(o.Meta)
		oids[i], metas[i] = o.ID, string(js)
	}
	return Statement{SQL: sqlschema.InsertSelect(table, moveSelects[1]), Args: []any{ids, oids, metas}, Expect: NoExpect, What: "publishing in the database"}
}

var moveSelects = [2]string{moveSelectFor(false), moveSelectFor(true)}

// moveSelectFor selects rows $1 (a bigint[]) as the messages the publisher
// path would send: the metadata the outbox derives from the columns,
// overridden by the metadata column, and metadata.EventID from event_id;
// traced, the metadata column overridden by the JSON objects $3 (a text[])
// of rows $2 (a bigint[]). outbox's TestInDatabasePublishSendsWhatThePublisherSends
// holds the two paths together.
//
// The metadata is written as JSON text when the metadata column names
// none of the derived keys (every row Add writes: it stores only what the
// columns do not say), which costs less than half of building it with
// jsonb functions; other rows take the jsonb path, whose || gives the
// override.
func moveSelectFor(traced bool) string {
	meta := `o.metadata`
	if traced {
		meta = `(o.metadata || COALESCE(tr.meta::jsonb, '{}'::jsonb))`
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
WHERE o.id = ANY($1::bigint[])`
	if traced {
		from = `
FROM millwright_outbox o LEFT JOIN unnest($2::bigint[], $3::text[]) tr(id, meta) ON tr.id = o.id
WHERE o.id = ANY($1::bigint[])`
	}
	return `SELECT o.event_id AS ` + sqlschema.ColUUID + `,
	COALESCE(convert_to(o.payload::text, 'UTF8'), o.payload_raw) AS ` + sqlschema.ColPayload + `,
	CASE WHEN NOT ` + meta + ` ?| ARRAY[` + strings.Join(keys, ", ") + `] THEN ` + text + `
	ELSE ` + merged + ` END AS ` + sqlschema.ColMetadata + `,
	o.id AS ` + sqlschema.ColPosition + from
}

// DatabaseIdentity names the database q reaches on its running server:
// its name and oid, and the server's start time (to the microsecond, as
// epoch seconds so that the session's TimeZone does not matter), which a
// copy of the database (a restore, a branch, a promoted standby) does not
// share. Every role may read all three.
func DatabaseIdentity(ctx context.Context, q Querier) (string, error) {
	var id string
	err := q.QueryRow(ctx, Statement{SQL: `SELECT current_database() || '/' || d.oid::text || '/' || extract(epoch FROM pg_postmaster_start_time())::text
		FROM pg_database d WHERE d.datname = current_database()`, Expect: NoExpect, What: "identifying the database"}, &id)
	return id, err
}
