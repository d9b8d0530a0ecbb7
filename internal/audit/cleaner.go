package audit

import (
	"time"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// DefaultRetention is how long audit rows are kept by default: one year,
// the span most audit policies ask for.
const DefaultRetention = 365 * 24 * time.Hour

var cleanerTable = cleaner.Table{
	Component: "audit", Rows: "audit rows",
	Store: storage.AuditRetention,
	// A day at least: a trail that forgets yesterday is no trail.
	DefaultRetention: DefaultRetention, MinRetention: 24 * time.Hour,
	Hint: cleaner.MissingTable("audit.Migrations()"),
}

// NewCleaner returns the retention cleaner of millwright_audit in db's
// search_path: rows older than cfg.Retention (default DefaultRetention, at
// least 24h) are deleted in bounded batches, one instance at a time.
func NewCleaner(db postgres.DB, cfg cleaner.Config) (*cleaner.Cleaner, error) {
	return cleaner.NewFrom(db, cleanerTable, cfg)
}
