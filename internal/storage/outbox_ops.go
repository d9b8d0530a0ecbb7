package storage

import (
	"context"
	"strconv"
	"time"
)

// The outbox's operator reads and writes: backlog figures, problems,
// retry-failed, and the checks a relay makes at start.

// OutboxStats is the backlog of millwright_outbox.
type OutboxStats struct {
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
}

// The oldest pending row is the oldest of the lanes' heads (one probe of
// the lane index per lane).
var outboxStatsSQL = `SELECT
	(SELECT count(*) FROM millwright_outbox WHERE status = 'pending'),
	COALESCE((SELECT extract(epoch FROM now() - created_at)::float8 FROM millwright_outbox WHERE id = (
		SELECT min(h.id) FROM generate_series(0, 63) AS l(lane)
		CROSS JOIN LATERAL (SELECT id FROM millwright_outbox WHERE ` + OutboxLaneExpr + ` = l.lane AND status = 'pending' ORDER BY id LIMIT 1) h)), 0),
	(SELECT count(*) FROM millwright_outbox WHERE status = 'failed')`

// ReadOutboxStats reads the backlog figures through the partial indexes on
// pending and failed rows only, so it stays cheap however many published
// rows the table holds.
func ReadOutboxStats(ctx context.Context, q Querier) (OutboxStats, error) {
	var s OutboxStats
	var age float64
	if err := q.QueryRow(ctx, Statement{SQL: outboxStatsSQL, Expect: NoExpect, What: "the outbox stats"}, &s.Pending, &age, &s.Failed); err != nil {
		return OutboxStats{}, err
	}
	s.OldestPendingAge = seconds(age)
	return s, nil
}

func seconds(s float64) time.Duration { return time.Duration(max(s, 0) * float64(time.Second)) }

// OutboxTopicStats is the backlog of one topic.
type OutboxTopicStats struct {
	Topic            string
	Pending          int64
	OldestPendingAge time.Duration
	Failed           int64
}

const outboxTopicStatsSQL = `SELECT topic,
		count(*) FILTER (WHERE status = 'pending'),
		COALESCE(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8, 0),
		count(*) FILTER (WHERE status = 'failed')
	FROM (
		SELECT topic, status, created_at FROM millwright_outbox WHERE status = 'pending'
		UNION ALL
		SELECT topic, status, created_at FROM millwright_outbox WHERE status = 'failed'
	) b GROUP BY topic ORDER BY topic`

// ReadOutboxTopicStats returns the pending and failed counts per topic, in
// topic order, reading only pending and failed rows.
func ReadOutboxTopicStats(ctx context.Context, q Querier) ([]OutboxTopicStats, error) {
	var out []OutboxTopicStats
	err := q.Query(ctx, Statement{SQL: outboxTopicStatsSQL, Expect: NoExpect, What: "the per-topic stats"}, func(r Row) error {
		var s OutboxTopicStats
		var age float64
		if err := r.Scan(&s.Topic, &s.Pending, &age, &s.Failed); err != nil {
			return err
		}
		s.OldestPendingAge = seconds(age)
		out = append(out, s)
		return nil
	})
	return out, err
}

// OutboxProblem is a failed row, or a pending row with failed attempts.
type OutboxProblem struct {
	ID                    int64
	EventID, Topic, AggID string
	Failed                bool
	RetryCount            int
	LastError             string
	CreatedAt, NextAt     time.Time
}

const outboxProblemsSQL = `(SELECT id, event_id, topic, aggregate_id, true, retry_count, left(coalesce(last_error, ''), $2), created_at, next_attempt_at
		FROM millwright_outbox WHERE status = 'failed' ORDER BY id DESC LIMIT $1)
	UNION ALL
	(SELECT id, event_id, topic, aggregate_id, false, retry_count, left(coalesce(last_error, ''), $2), created_at, next_attempt_at
		FROM millwright_outbox WHERE status = 'pending' AND retry_count > 0 ORDER BY retry_count DESC, id LIMIT $1)`

// ReadOutboxProblems returns at most limit failed rows, the most recent
// first, then at most limit retrying rows, those with the most failed
// attempts first, their last error cut to errChars characters.
func ReadOutboxProblems(ctx context.Context, q Querier, limit, errChars int) ([]OutboxProblem, error) {
	var out []OutboxProblem
	err := q.Query(ctx, Statement{SQL: outboxProblemsSQL, Args: []any{limit, errChars}, Expect: NoExpect, What: "the failed and retrying events"}, func(r Row) error {
		var p OutboxProblem
		if err := r.Scan(&p.ID, &p.EventID, &p.Topic, &p.AggID, &p.Failed, &p.RetryCount, &p.LastError, &p.CreatedAt, &p.NextAt); err != nil {
			return err
		}
		out = append(out, p)
		return nil
	})
	return out, err
}

// FailedOutboxEvent is a failed row, as ListFailedEvents reads it.
type FailedOutboxEvent struct {
	ID                    int64
	EventID, Topic, AggID string
	RetryCount            int
	LastError             string
	CreatedAt             time.Time
}

const listFailedSQL = `SELECT id, event_id, topic, aggregate_id, retry_count, COALESCE(last_error, ''), created_at
	FROM millwright_outbox
	WHERE status = 'failed' AND ($1 = '' OR topic = $1) AND (NOT $3 OR id = ANY($2::bigint[]))
	ORDER BY id`

// ListFailedEvents returns the failed rows of topic ("" for all) among ids
// (nil for all), in id order; with lock, FOR UPDATE (q is then a
// transaction).
func ListFailedEvents(ctx context.Context, q Querier, topic string, ids []int64, lock bool) ([]FailedOutboxEvent, error) {
	sqlText := listFailedSQL
	if lock {
		sqlText += " FOR UPDATE"
	}
	var out []FailedOutboxEvent
	s := Statement{SQL: sqlText, Args: []any{topic, nonNil(ids), ids != nil}, Expect: NoExpect, What: "listing failed rows"}
	err := q.Query(ctx, s, func(r Row) error {
		var e FailedOutboxEvent
		if err := r.Scan(&e.ID, &e.EventID, &e.Topic, &e.AggID, &e.RetryCount, &e.LastError, &e.CreatedAt); err != nil {
			return err
		}
		out = append(out, e)
		return nil
	})
	return out, err
}

func nonNil(ids []int64) []int64 {
	if ids == nil {
		return []int64{}
	}
	return ids
}

// ResetFailedEvents puts the failed rows ids back to pending with a fresh
// retry budget and returns how many it reset. While Debezium capture is on
// it refuses (an error wrapping ErrCaptureActive, naming the fix) and
// changes nothing: the connector never streams the UPDATE, so the row
// would stay unsent (CheckCaptureOff). A switch to Debezium that begins
// after the check waits for this transaction (CREATE TRIGGER and the slot
// do), and the reset rows are then before its boundary: the relays it
// waits for publish them.
func ResetFailedEvents(ctx context.Context, q Querier, ids []int64) (int64, error) {
	if err := CheckCaptureOff(ctx, q, "retry-failed"); err != nil {
		return 0, err
	}
	return q.Exec(ctx, Statement{SQL: `UPDATE millwright_outbox SET status = 'pending', retry_count = 0, next_attempt_at = now()
		WHERE id = ANY($1::bigint[]) AND status = 'failed'`, Args: []any{ids}, Expect: NoExpect,
		What: "resetting " + strconv.Itoa(len(ids)) + " failed row(s)"})
}

// The outbox's wake-up channel's forms (migration 006): "millwright_outbox:"
// + schema for a schema of at most 45 bytes, else "millwright_outbox#" +
// the hex MD5 of the schema.
const (
	OutboxNotifyPrefix     = "millwright_outbox:"
	OutboxNotifyHashPrefix = "millwright_outbox#"
	// OutboxMaxPlainSchemaBytes is the longest schema whose channel is
	// OutboxNotifyPrefix + schema (Postgres' 63-byte names).
	OutboxMaxPlainSchemaBytes = 63 - len(OutboxNotifyPrefix)
)

// OutboxNotifyChannelSQL is the wake-up channel in SQL, of the schema name
// expression expr; identical to the trigger's (migration 006).
func OutboxNotifyChannelSQL(expr string) string {
	return `CASE WHEN octet_length(` + expr + `) <= ` + strconv.Itoa(OutboxMaxPlainSchemaBytes) +
		` THEN '` + OutboxNotifyPrefix + `' || ` + expr +
		` ELSE '` + OutboxNotifyHashPrefix + `' || md5(` + expr + `) END`
}

const outboxOfSQL = ` FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'millwright_outbox'::regclass`

// NotifyOutboxRelays wakes the relays listening on the outbox in q's
// search_path (at commit, in a transaction).
func NotifyOutboxRelays(ctx context.Context, q Querier) error {
	_, err := q.Exec(ctx, Statement{SQL: `SELECT pg_notify(` + OutboxNotifyChannelSQL("n.nspname::text") + `, '')` + outboxOfSQL,
		Expect: NoExpect, What: "notifying the relays"})
	return err
}

// OutboxTable identifies the outbox table in q's search_path: its schema
// and oid, the database's name, the server's version (server_version_num)
// and the wake-up channel as the server names it.
type OutboxTable struct {
	Schema   string
	OID      uint32
	Database string
	Version  int
	Channel  string
}

// FindOutboxTable identifies the outbox table in q's search_path.
func FindOutboxTable(ctx context.Context, q Querier) (OutboxTable, error) {
	var t OutboxTable
	var oid int64
	s := Statement{SQL: `SELECT n.nspname::text, c.oid::int8, current_database()::text, current_setting('server_version_num')::int, ` +
		OutboxNotifyChannelSQL("n.nspname::text") + outboxOfSQL, Expect: NoExpect, What: "finding millwright_outbox"}
	if err := q.QueryRow(ctx, s, &t.Schema, &oid, &t.Database, &t.Version, &t.Channel); err != nil {
		return OutboxTable{}, err
	}
	t.OID = uint32(oid)
	return t, nil
}

// CheckOutboxColumns fails (with SQLSTATE 42703) when millwright_outbox
// lacks the columns of the newest migration the relay's statements use
// (007's first_failed_at).
func CheckOutboxColumns(ctx context.Context, q Querier) error {
	return q.Query(ctx, Statement{SQL: `SELECT first_failed_at FROM millwright_outbox LIMIT 0`, Expect: NoExpect, What: "checking millwright_outbox's columns"},
		func(Row) error { return nil })
}
