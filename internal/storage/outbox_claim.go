package storage

import (
	"context"
	"database/sql"
	"strconv"
	"time"
)

// The relay's claim and marks on millwright_outbox. Lanes (OutboxLaneExpr)
// are divided between relays (outbox_lanes.go); only the relay holding a
// lane claims its rows, so nothing is locked: a row stays pending until
// it is marked.

// blockedCTE names the aggregates held back by a failing event: from the
// event on, nothing of the aggregate goes out until its backoff ends
// (the small index of failing rows answers it).
const blockedCTE = `blocked AS MATERIALIZED (
	SELECT aggregate_type, aggregate_id, min(id) AS head FROM millwright_outbox
	WHERE status = 'pending' AND retry_count > 0 AND next_attempt_at > now()
	GROUP BY aggregate_type, aggregate_id
)`

// claimLane selects, for lane l.lane, the due rows in id order that no
// failing event holds back: the columns cols, then tail (a LIMIT and/or
// OFFSET). An aggregate never overtakes its failing event, including
// events written after the failure.
func claimLane(cols, tail string) string {
	return `SELECT ` + cols + ` FROM millwright_outbox o
		WHERE ` + OutboxLaneExpr + ` = l.lane AND status = 'pending' AND next_attempt_at <= now()
		  AND NOT EXISTS (SELECT 1 FROM blocked b WHERE b.aggregate_type = o.aggregate_type
			AND b.aggregate_id = o.aggregate_id AND b.head < o.id)
		ORDER BY id
		` + tail
}

// spreadLanes selects the columns cols of at most $2 due rows of the lanes
// in $1 (an int[]), spread over the lanes: first at most $3[i] rows of
// lane $1[i] (its share of the batch, an int[] of the same length), then,
// if the batch is not full, the lanes' next rows, lane after lane. Both
// passes read one snapshot with one now(), and the second skips exactly
// the rows the first took (same filter, same order, OFFSET the same
// share), so each lane's rows are the first of the lane in id order: no
// aggregate skips one of its rows, in this batch or the next.
func spreadLanes(cols string) string {
	return `(SELECT c.* FROM unnest($1::int[], $3::int[]) AS l(lane, share)
	CROSS JOIN LATERAL (` + claimLane(cols, `LIMIT l.share`) + `) c)
UNION ALL
(SELECT c.* FROM unnest($1::int[], $3::int[]) AS l(lane, share)
	CROSS JOIN LATERAL (` + claimLane(cols, `OFFSET l.share LIMIT $2`) + `) c)
LIMIT $2`
}

// outboxClaimedCTE names, as CTE claimed, the ids of at most $2 due rows
// of the lanes in $1, spread over the lanes by spreadLanes.
var outboxClaimedCTE = `WITH ` + blockedCTE + `, claimed AS (
	` + spreadLanes("id") + `
)`

// OutboxClaimSQL is the claim of the publisher path, in one pass: $1 the
// lanes (int[]), $2 the batch size, $3 each lane's first share (int[]).
// Exported for the outbox's plan tests (EXPLAIN).
var OutboxClaimSQL = `WITH ` + blockedCTE + `
` + spreadLanes(`l.lane, o.id, o.event_id, o.topic, o.aggregate_type, o.aggregate_id, o.event_type,
	o.payload::text, o.payload_raw, NULLIF(o.metadata, '{}')::text, o.retry_count,
	(extract(epoch FROM o.created_at) * 1000000)::int8,
	(extract(epoch FROM now() - o.first_failed_at) * 1000000)::int8`)

// ClaimedEvent is one row of ClaimEvents.
type ClaimedEvent struct {
	Lane                                   int32
	ID                                     int64
	EventID, Topic, AggType, AggID, EvType string
	Payload                                sql.NullString // JSON payload, or NULL for a raw one
	Raw                                    []byte
	Metadata                               sql.NullString // JSON object; NULL for none
	RetryCount                             int
	CreatedAt                              time.Time
	// Failing is how long ago the row first failed, at the claim's now();
	// 0 when it has not (or its first failure is not recorded).
	Failing time.Duration
}

// ClaimEvents reads at most batch due rows of the lanes, spread over them
// (lane lanes[i] first gives at most shares[i] rows), each lane's in id
// order, and calls each for every row. It claims by reading: only the
// relay holding the lanes calls it.
func ClaimEvents(ctx context.Context, q Querier, lanes []int32, batch int, shares []int32, each func(ClaimedEvent) error) error {
	s := Statement{SQL: OutboxClaimSQL, Args: []any{int64s(lanes), batch, int64s(shares)}, Expect: NoExpect, What: "the claim"}
	return q.Query(ctx, s, func(r Row) error {
		var (
			e       ClaimedEvent
			lane    int64
			created int64 // µs since the epoch: cheaper to read than a timestamp
			failing sql.NullInt64
		)
		if err := r.Scan(&lane, &e.ID, &e.EventID, &e.Topic, &e.AggType, &e.AggID, &e.EvType, &e.Payload, &e.Raw, &e.Metadata, &e.RetryCount, &created, &failing); err != nil {
			return err
		}
		e.Lane, e.CreatedAt = int32(lane), time.UnixMicro(created)
		if failing.Valid {
			e.Failing = max(time.Duration(failing.Int64)*time.Microsecond, time.Microsecond)
		}
		return each(e)
	})
}

// heldBy is the condition, on a row of millwright_outbox, that its lane is
// held by the relay $n under a lease that has not ended (read once per
// statement: an InitPlan over the 64 lanes).
func heldBy(n int) string {
	return OutboxLaneExpr + ` = ANY(ARRAY(SELECT lane FROM millwright_outbox_lanes WHERE owner = $` + strconv.Itoa(n) + ` AND lease_until > now()))`
}

// markPublishedSQL commits without waiting for the WAL flush: a server
// crash may undo the last marks; their rows, still pending, are published
// again, in order, as after a relay crash before its mark.
var markPublishedSQL = `WITH async AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
UPDATE millwright_outbox SET status = 'published', published_at = now() FROM async
WHERE id = ANY($1::bigint[]) AND status = 'pending' AND ` + heldBy(2)

// MarkPublished marks the pending rows ids published, those of lanes relay
// owner still holds only, in one statement (one round trip), and returns
// how many it marked.
func MarkPublished(ctx context.Context, q Querier, owner string, ids []int64) (int64, error) {
	return q.Exec(ctx, Statement{SQL: markPublishedSQL, Args: []any{ids, owner}, Expect: NoExpect,
		What: "marking " + strconv.Itoa(len(ids)) + " row(s) published"})
}

// FailedAttempt is one failed publish RecordFailures records.
type FailedAttempt struct {
	ID    int64
	Delay time.Duration // before the next attempt
	Error string
	Final bool // the row becomes failed
}

// RecordedFailure is a failed attempt RecordFailures recorded, with the
// row's first failure and the database's now().
type RecordedFailure struct {
	ID               int64
	FirstFailed, Now time.Time
}

var recordFailuresSQL = `UPDATE millwright_outbox t SET
		retry_count = t.retry_count + 1,
		last_error = u.err,
		first_failed_at = CASE WHEN t.retry_count = 0 THEN now() ELSE coalesce(t.first_failed_at, now()) END,
		status = CASE WHEN u.final THEN 'failed' ELSE 'pending' END,
		next_attempt_at = now() + u.delay_ms * interval '1 millisecond'
	FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[]::bool[]) AS u(row_id, delay_ms, err, final)
	WHERE t.id = u.row_id AND t.status = 'pending' AND ` + heldBy(5) + `
	RETURNING t.id, (extract(epoch FROM t.first_failed_at) * 1000000)::int8, (extract(epoch FROM now()) * 1000000)::int8`

// RecordFailures records failed attempts of pending rows of lanes relay
// owner still holds, in one statement: a backoff (the claim holds the
// row's aggregate back until it ends) or, Final, the failed state. It
// returns the rows it changed.
func RecordFailures(ctx context.Context, q Querier, owner string, fs []FailedAttempt) ([]RecordedFailure, error) {
	ids := make([]int64, len(fs))
	delays := make([]int64, len(fs))
	msgs := make([]string, len(fs))
	final := make([]string, len(fs))
	for i, f := range fs {
		ids[i], delays[i], msgs[i], final[i] = f.ID, f.Delay.Milliseconds(), f.Error, strconv.FormatBool(f.Final)
	}
	s := Statement{SQL: recordFailuresSQL, Args: []any{ids, delays, msgs, final, owner}, Expect: NoExpect,
		What: "recording " + strconv.Itoa(len(fs)) + " failed publish(es)"}
	var out []RecordedFailure
	err := q.Query(ctx, s, func(r Row) error {
		var id, first, now int64
		if err := r.Scan(&id, &first, &now); err != nil {
			return err
		}
		out = append(out, RecordedFailure{ID: id, FirstFailed: time.UnixMicro(first), Now: time.UnixMicro(now)})
		return nil
	})
	return out, err
}
