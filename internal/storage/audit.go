package storage

import (
	"context"
	"database/sql"
	"strconv"
	"time"
)

// Audit: millwright_audit, one row per operator command run that changed
// (or, dry, would change) millwright's tables.

// AuditRow is one row of millwright_audit.
type AuditRow struct {
	ID        int64
	At        time.Time
	User      string
	Host      string
	Command   string
	Args      []string
	DryRun    bool
	Confirmed string
	Affected  int64
	// Error is "" for none (stored as NULL).
	Error string
	// Change is "" for none (stored as NULL; audit migration 002).
	Change string
}

const (
	auditExistsSQL = `SELECT to_regclass('millwright_audit')::text`
	insertAuditSQL = `INSERT INTO millwright_audit (os_user, hostname, command, args, dry_run, confirmed, affected, error, change)
VALUES ($1, $2, $3, $4, $5, $6, $7, NULLIF($8, ''), NULLIF($9, '')) RETURNING id`
	listAuditSQL = `SELECT id, at, os_user, hostname, command, args, dry_run, confirmed, affected, COALESCE(error, ''), COALESCE(change, '')
FROM millwright_audit ORDER BY id DESC`
)

// AuditTableExists reports whether millwright_audit is in the search_path.
func AuditTableExists(ctx context.Context, q Querier) (bool, error) {
	var name sql.NullString
	if err := q.QueryRow(ctx, Statement{SQL: auditExistsSQL, Expect: NoExpect, What: "looking for millwright_audit"}, &name); err != nil {
		return false, err
	}
	return name.Valid, nil
}

// InsertAudit writes r (its ID and At are the database's) and returns its
// id. A missing table is SQLSTATE 42P01 (Code).
func InsertAudit(ctx context.Context, q Querier, r AuditRow) (int64, error) {
	args := r.Args
	if args == nil {
		args = []string{}
	}
	var id int64
	err := q.QueryRow(ctx, Statement{SQL: insertAuditSQL, Args: []any{
		r.User, r.Host, r.Command, args, r.DryRun, r.Confirmed, r.Affected, r.Error, r.Change,
	}, Expect: NoExpect, What: "writing to millwright_audit"}, &id)
	return id, err
}

// ListAudit returns the newest limit rows, newest first (limit <= 0: all).
func ListAudit(ctx context.Context, q Querier, limit int) ([]AuditRow, error) {
	s := Statement{SQL: listAuditSQL, Expect: NoExpect, What: "reading millwright_audit"}
	if limit > 0 {
		s.SQL += " LIMIT " + strconv.Itoa(limit)
	}
	var out []AuditRow
	err := q.Query(ctx, s, func(r Row) error {
		var e AuditRow
		err := r.Scan(&e.ID, &e.At, &e.User, &e.Host, &e.Command, Array(&e.Args), &e.DryRun, &e.Confirmed, &e.Affected, &e.Error, &e.Change)
		out = append(out, e)
		return err
	})
	return out, err
}
