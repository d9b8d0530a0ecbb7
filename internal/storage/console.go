package storage

import (
	"context"
	"time"
)

// The operator console's statements (package console): the schemas it
// offers, its summaries of dead letters, sagas and relays, and the two
// conditional updates that take a dead letter out of the 'dead' state.

// ConsoleSchemasSQL lists the schemas holding at least one millwright table,
// by name.
const consoleSchemasSQL = `SELECT DISTINCT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
	WHERE c.relkind IN ('r', 'p') AND c.relname = ANY($1::text[]) ORDER BY 1`

// ConsoleTables are the tables the console reads; a schema with any of them
// is offered.
var ConsoleTables = []string{"millwright_dead_letters", "millwright_outbox", "millwright_saga_instances", "millwright_audit"}

// ListConsoleSchemas returns the schemas holding a millwright table, by
// name.
func ListConsoleSchemas(ctx context.Context, q Querier) ([]string, error) {
	var out []string
	err := q.Query(ctx, Statement{SQL: consoleSchemasSQL, Args: []any{ConsoleTables}, Expect: NoExpect, What: "listing millwright schemas"}, func(r Row) error {
		var s string
		err := r.Scan(&s)
		out = append(out, s)
		return err
	})
	return out, err
}

// ConsoleTablesIn returns which of ConsoleTables the search_path reaches.
func ConsoleTablesIn(ctx context.Context, q Querier) (map[string]bool, error) {
	out := map[string]bool{}
	err := q.Query(ctx, Statement{SQL: `SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass(t) IS NOT NULL`,
		Args: []any{ConsoleTables}, Expect: NoExpect, What: "looking for millwright tables"}, func(r Row) error {
		var t string
		err := r.Scan(&t)
		out[t] = true
		return err
	})
	return out, err
}

// SetLocalSearchPath is the first statement of a console transaction: it
// points the transaction's search_path at schema, quoted by the server
// (the name is an argument, never SQL text).
func SetLocalSearchPath(schema string) Statement {
	return Statement{SQL: `SELECT set_config('search_path', quote_ident($1), true)`, Args: []any{schema},
		Expect: NoExpect, What: "setting the search_path to schema " + schema}
}

// DeadLetterGroup is the dead letters of one original topic and error type.
type DeadLetterGroup struct {
	Topic, ErrorType string
	// Count counts the rows; Dead those still in the 'dead' state.
	Count, Dead         int64
	FirstSeen, LastSeen time.Time
	// SampleError is the error of the newest row.
	SampleError string
}

// GroupDeadLetters returns the rows f selects (f.IDs, f.AfterID and f.Limit
// ignored) grouped by original topic and error type, by topic then the
// largest group first.
func GroupDeadLetters(ctx context.Context, q Querier, f DeadLetterFilter) ([]DeadLetterGroup, error) {
	f.IDs, f.AfterID, f.Limit = nil, 0, 0
	where, args := f.where()
	// The newest error of a group is read by the group's largest id, one
	// index probe per group, rather than aggregated.
	text := `SELECT g.original_topic, g.error_type, g.n, g.dead, g.first_at, g.last_at, d.error FROM (
	SELECT original_topic, error_type, count(*) AS n, count(*) FILTER (WHERE state = 'dead') AS dead,
		min(first_failure_at) AS first_at, max(last_failure_at) AS last_at, max(id) AS newest
	FROM millwright_dead_letters` + where + ` GROUP BY original_topic, error_type) g
	JOIN millwright_dead_letters d ON d.id = g.newest
	ORDER BY g.original_topic, g.n DESC, g.error_type`
	var out []DeadLetterGroup
	err := q.Query(ctx, Statement{SQL: text, Args: args, Expect: NoExpect, What: "grouping dead letters"}, func(r Row) error {
		var g DeadLetterGroup
		err := r.Scan(&g.Topic, &g.ErrorType, &g.Count, &g.Dead, &g.FirstSeen, &g.LastSeen, &g.SampleError)
		out = append(out, g)
		return err
	})
	return out, err
}

// TakeDeadLetter moves row id from 'dead' to state (replayed or superseded)
// in tx; supersededBy and actor are recorded for a superseded row. Its
// Expect of one row makes a row already taken (by another edit, a replay,
// or the CLI's replay, whose row lock it waits for) a *ConflictError, and
// aborts the transaction, so nothing queued after it commits.
func TakeDeadLetter(ctx context.Context, tx Querier, id int64, state, supersededBy, actor string) error {
	_, err := tx.Exec(ctx, Statement{SQL: `UPDATE millwright_dead_letters SET state = $2, replayed_at = now(), replay_count = replay_count + 1,
	superseded_at = CASE WHEN $2 = 'superseded' THEN now() END, superseded_by = $3, superseded_actor = $4
	WHERE id = $1 AND state = 'dead'`, Args: []any{id, state, supersededBy, actor}, Expect: 1,
		What: "taking dead letter out of the dead state"})
	return err
}

// SagaSummary counts the instances of one type in one state.
type SagaSummary struct {
	Type, State string
	Count       int64
	Oldest      time.Time
}

// SummarizeSagas counts instances by type and state, by type then state.
func SummarizeSagas(ctx context.Context, q Querier) ([]SagaSummary, error) {
	var out []SagaSummary
	err := q.Query(ctx, Statement{SQL: `SELECT type, state, count(*), min(created_at) FROM millwright_saga_instances
	GROUP BY type, state ORDER BY type, state`, Expect: NoExpect, What: "counting sagas"}, func(r Row) error {
		var s SagaSummary
		err := r.Scan(&s.Type, &s.State, &s.Count, &s.Oldest)
		out = append(out, s)
		return err
	})
	return out, err
}

// OutboxLane is one row of millwright_outbox_lanes.
type OutboxLane struct {
	Lane       int
	Owner      string
	LeaseUntil time.Time
	Lent, Held bool
}

// OutboxRelayRow is one row of millwright_outbox_relays.
type OutboxRelayRow struct {
	ID        string
	SeenUntil time.Time
	Load      string
	Live      bool
}

// ReadOutboxLanes returns the 64 lanes, by lane; Held is a lease still
// running.
func ReadOutboxLanes(ctx context.Context, q Querier) ([]OutboxLane, error) {
	var out []OutboxLane
	// A lane never leased has lease_until -infinity, which time.Time cannot
	// hold: it reads as the zero time.
	err := q.Query(ctx, Statement{SQL: `SELECT lane, COALESCE(owner, ''),
	CASE WHEN isfinite(lease_until) THEN lease_until ELSE '0001-01-01 00:00:00+00' END, lent, lease_until > now()
	FROM millwright_outbox_lanes ORDER BY lane`, Expect: NoExpect, What: "reading the outbox lanes"}, func(r Row) error {
		var l OutboxLane
		err := r.Scan(&l.Lane, &l.Owner, &l.LeaseUntil, &l.Lent, &l.Held)
		out = append(out, l)
		return err
	})
	return out, err
}

// ReadOutboxRelays returns the relays that announced themselves, by id.
func ReadOutboxRelays(ctx context.Context, q Querier) ([]OutboxRelayRow, error) {
	var out []OutboxRelayRow
	err := q.Query(ctx, Statement{SQL: `SELECT id, CASE WHEN isfinite(seen_until) THEN seen_until ELSE '0001-01-01 00:00:00+00' END,
	load, seen_until > now() FROM millwright_outbox_relays ORDER BY id`,
		Expect: NoExpect, What: "reading the outbox relays"}, func(r Row) error {
		var x OutboxRelayRow
		err := r.Scan(&x.ID, &x.SeenUntil, &x.Load, &x.Live)
		out = append(out, x)
		return err
	})
	return out, err
}

// OutboxTopicBacklog is one topic's pending (of which Retrying have failed
// attempts) and failed rows.
type OutboxTopicBacklog struct {
	Topic                     string
	Pending, Retrying, Failed int64
	OldestPendingAge          time.Duration
}

// ReadOutboxBacklog returns the backlog per topic, in topic order, reading
// only pending and failed rows (their partial indexes).
func ReadOutboxBacklog(ctx context.Context, q Querier) ([]OutboxTopicBacklog, error) {
	var out []OutboxTopicBacklog
	err := q.Query(ctx, Statement{SQL: `SELECT topic, count(*) FILTER (WHERE status = 'pending'),
		count(*) FILTER (WHERE status = 'pending' AND retry_count > 0), count(*) FILTER (WHERE status = 'failed'),
		COALESCE(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8, 0)
	FROM (
		SELECT topic, status, retry_count, created_at FROM millwright_outbox WHERE status = 'pending'
		UNION ALL
		SELECT topic, status, retry_count, created_at FROM millwright_outbox WHERE status = 'failed'
	) b GROUP BY topic ORDER BY topic`, Expect: NoExpect, What: "the outbox backlog per topic"}, func(r Row) error {
		var b OutboxTopicBacklog
		var age float64
		err := r.Scan(&b.Topic, &b.Pending, &b.Retrying, &b.Failed, &age)
		b.OldestPendingAge = seconds(age)
		out = append(out, b)
		return err
	})
	return out, err
}
