package storage

import (
	"context"
	"strconv"
	"strings"
)

// The sql transport's own statements (transport/sql): its xmin horizon
// check, and the lookups and schema wrapping it adds to watermill-sql.

// XminHorizon is the server's xmin horizon and the transaction holding it,
// as ReadXminHorizon finds them (transport/sql.Horizon documents each
// field).
type XminHorizon struct {
	// XID is pg_snapshot_xmin of the current snapshot, as text.
	XID                                string
	Held, Found, Hidden                bool
	PID                                int
	Database, User, Application, State string
	Prepared                           bool
	GID                                string
	// AgeSeconds is how long the holder's transaction has been open.
	AgeSeconds float64
}

// horizonQuery finds the transaction whose id is the horizon, among
// sessions (pg_stat_activity, every database) and prepared transactions.
// The horizon is the oldest running id, so an exact match names the one
// transaction that holds it. xmin = xmax does not mean that none runs:
// xmax is the latest completed id + 1, so a running transaction that took
// the newest id is the horizon with xmin = xmax.
const horizonQuery = `SELECT x.xmin::text, x.xmin <> x.xmax OR h.pid IS NOT NULL, h.pid IS NOT NULL, COALESCE(h.hidden, false),
	COALESCE(h.pid, 0), COALESCE(h.database, ''), COALESCE(h.usename, ''), COALESCE(h.application_name, ''),
	COALESCE(h.state, ''), h.gid IS NOT NULL, COALESCE(h.gid, ''), COALESCE(h.age_seconds, 0)
FROM (SELECT pg_snapshot_xmin(s) AS xmin, pg_snapshot_xmax(s) AS xmax FROM pg_current_snapshot() s) x
LEFT JOIN LATERAL (
	SELECT a.pid, a.xact_start IS NULL AS hidden, a.datname::text AS database, a.usename::text AS usename,
		a.application_name, a.state, NULL::text AS gid, COALESCE(extract(epoch FROM now() - a.xact_start), 0)::float8 AS age_seconds
	FROM pg_stat_activity a WHERE a.backend_xid = x.xmin::xid
	UNION ALL
	SELECT 0, false, p.database::text, p.owner::text, '', 'prepared', p.gid, extract(epoch FROM now() - p.prepared)::float8
	FROM pg_prepared_xacts p WHERE p.transaction = x.xmin::xid
	LIMIT 1
) h ON true`

// ReadXminHorizon reads the server's xmin horizon and its holder in one
// statement.
func ReadXminHorizon(ctx context.Context, q Querier) (XminHorizon, error) {
	var h XminHorizon
	err := q.QueryRow(ctx, S(horizonQuery), &h.XID, &h.Held, &h.Found, &h.Hidden, &h.PID, &h.Database, &h.User,
		&h.Application, &h.State, &h.Prepared, &h.GID, &h.AgeSeconds)
	return h, err
}

// CountBehindHorizon counts, up to limit, the rows of a watermill-sql
// messages table (quotedTable, as its schema adapter names it) committed
// at or above the xmin horizon: those no consumer group can read yet. The
// primary key starts with transaction_id, so this reads only them.
func CountBehindHorizon(ctx context.Context, q Querier, quotedTable string, limit int) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM (SELECT 1 FROM `+quotedTable+
		` WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot()) LIMIT `+strconv.Itoa(limit)+`) w`), &n)
	return n, err
}

// QualifiedTableName returns the schema-qualified, quoted name of the
// table name resolves to on q's search_path (no row when it does not
// exist).
func QualifiedTableName(ctx context.Context, q Querier, name string) (string, error) {
	var qualified string
	err := q.QueryRow(ctx, S(`SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass($1::text)`, name), &qualified)
	return qualified, err
}

// TolerateExisting wraps a schema-creating statement (without arguments)
// so that the server runs it again, up to 10 times, when a concurrent
// creator of the same objects makes it fail with unique_violation,
// duplicate_table or duplicate_object; the statement must be idempotent
// (IF NOT EXISTS). A statement already wrapped is returned as it is.
func TolerateExisting(stmt string) string {
	if strings.Contains(stmt, "$mw$") {
		return stmt
	}
	stmt = strings.TrimRight(strings.TrimSpace(stmt), ";")
	return "DO $mw$ BEGIN FOR attempt IN 1..10 LOOP BEGIN " + stmt +
		"; EXIT; EXCEPTION WHEN unique_violation OR duplicate_table OR duplicate_object THEN IF attempt = 10 THEN RAISE; END IF; END; END LOOP; END $mw$"
}
