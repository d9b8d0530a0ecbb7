package audit

import (
	"database/sql"
	"time"

	"github.com/millwright/millwright/internal/cleaner"
)

// DefaultRetention is how long audit rows are kept by default: one year,
// the span most audit policies ask for.
const DefaultRetention = 365 * 24 * time.Hour

var cleanerTable = cleaner.Table{
	Component: "audit", Name: "millwright_audit", Rows: "audit rows",
	Key: "id", OrderBy: "at",
	// Served by millwright_audit_at_idx.
	Where:     `at < now() - $1 * interval '1 millisecond'`,
	LockClass: 0x6d774155, // "mwAU"
	// A day at least: a trail that forgets yesterday is no trail.
	DefaultRetention: DefaultRetention, MinRetention: 24 * time.Hour,
	Hint: cleaner.MissingTable("audit.Migrations()"),
}

// NewCleaner returns the retention cleaner of millwright_audit in db's
// search_path: rows older than cfg.Retention (default DefaultRetention, at
// least 24h) are deleted in bounded batches, one instance at a time.
func NewCleaner(db *sql.DB, cfg cleaner.Config) (*cleaner.Cleaner, error) {
	return cleaner.New(db, cleanerTable, cfg)
}
