package dlq

import (
	"time"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// DefaultRetention is how long a Cleaner keeps dead letters by default:
// 90 days. The depth alert fires within minutes of a dead letter, so a
// dead letter this old has either been replayed or been judged not worth
// replaying.
const DefaultRetention = 90 * 24 * time.Hour

// CleanerConfig configures a Cleaner (the same for every millwright
// cleaner). The zero value is valid. Retention: how long a dead letter is
// kept after it was recorded, replayed or not, default DefaultRetention, at
// least one hour.
type CleanerConfig = cleaner.Config

// CleanStats reports one cleaning round: dead letters deleted, batches,
// and whether the round was skipped because another cleaner held the lock.
type CleanStats = cleaner.Stats

var cleanerTable = cleaner.Table{
	Component: "dlq", Rows: "dead letters",
	Store:            storage.DLQRetention,
	DefaultRetention: DefaultRetention, MinRetention: time.Hour,
	Hint: cleaner.MissingTable("dlq.Migrations()"),
}

// Cleaner deletes dead letters recorded longer ago than the retention
// period, replayed or not, in bounded batches, on one instance at a time
// (per schema). Use `millwright dlq clean --dry-run` to see how many a
// round would delete.
// Its methods are every millwright cleaner's (internal/cleaner): Run,
// Close (drains, then cancels after CloseTimeout), Running, RunOnce and
// Count (the dry run).
type Cleaner = cleaner.Cleaner

// NewCleaner returns a cleaner of the dead-letter table in db's search_path.
func NewCleaner(db postgres.DB, cfg CleanerConfig) (*Cleaner, error) {
	return cleaner.NewFrom(db, cleanerTable, cfg)
}
