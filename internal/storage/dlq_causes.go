package storage

import (
	"context"
	"time"
)

// DeadLetterCauseRow is one group of GroupDeadLetterCauses: the rows of
// one fingerprint or, for rows without one (recorded before dlq
// migration 006), of one handler, error type and error (Legacy true), which
// the caller fingerprints and merges.
type DeadLetterCauseRow struct {
	Fingerprint               string
	Legacy                    bool
	Handler, ErrorType, Error string
	Count, Dead               int64
	FirstSeen, LastSeen       time.Time
	Topics                    []string
	// The newest row's id, message UUID (its text) and error.
	SampleID                int64
	SampleUUID, SampleError string
}

// GroupDeadLetterCauses returns the rows f selects (f.IDs, f.AfterID and
// f.Limit ignored) grouped by fingerprint, the rows without one by
// handler, error type and error. The newest row of a group is read by its
// id, one index probe per group.
func GroupDeadLetterCauses(ctx context.Context, q Querier, f DeadLetterFilter) ([]DeadLetterCauseRow, error) {
	f.IDs, f.AfterID, f.Limit = nil, 0, 0
	where, args := f.where()
	text := `SELECT COALESCE(g.fingerprint, ''), g.fingerprint IS NULL, g.handler, g.error_type, COALESCE(g.legacy_error, ''),
	g.n, g.dead, g.first_at, g.last_at, g.topics, d.id, d.message_uuid, d.error FROM (
	SELECT fingerprint, min(handler) AS handler, min(error_type) AS error_type, CASE WHEN fingerprint IS NULL THEN error END AS legacy_error,
		count(*) AS n, count(*) FILTER (WHERE state = 'dead') AS dead, min(first_failure_at) AS first_at, max(last_failure_at) AS last_at,
		array_agg(DISTINCT original_topic ORDER BY original_topic) AS topics, max(id) AS newest
	FROM millwright_dead_letters` + where + `
	GROUP BY fingerprint, CASE WHEN fingerprint IS NULL THEN handler END, CASE WHEN fingerprint IS NULL THEN error_type END,
		CASE WHEN fingerprint IS NULL THEN error END) g
	JOIN millwright_dead_letters d ON d.id = g.newest
	ORDER BY g.n DESC, g.last_at DESC`
	var out []DeadLetterCauseRow
	err := q.Query(ctx, Statement{SQL: text, Args: args, Expect: NoExpect, What: "grouping dead letters by cause"}, func(r Row) error {
		var g DeadLetterCauseRow
		err := r.Scan(&g.Fingerprint, &g.Legacy, &g.Handler, &g.ErrorType, &g.Error, &g.Count, &g.Dead, &g.FirstSeen, &g.LastSeen,
			Array(&g.Topics), &g.SampleID, &g.SampleUUID, &g.SampleError)
		out = append(out, g)
		return err
	})
	return out, err
}

// UnfingerprintedCauses returns the distinct handler, error type and
// error of the rows without a fingerprint, for a filter by fingerprint
// (DeadLetterFilter.Unfingerprinted).
func UnfingerprintedCauses(ctx context.Context, q Querier) ([]Cause, error) {
	var out []Cause
	err := q.Query(ctx, S(`SELECT DISTINCT handler, error_type, error FROM millwright_dead_letters WHERE fingerprint IS NULL`), func(r Row) error {
		var c Cause
		err := r.Scan(&c.Handler, &c.ErrorType, &c.Error)
		out = append(out, c)
		return err
	})
	return out, err
}
