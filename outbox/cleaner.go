package outbox

import (
	"time"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// DefaultRetention is how long a Cleaner keeps published rows by
// default (for audits and replays).
const DefaultRetention = 7 * 24 * time.Hour

// CleanerConfig configures a Cleaner (the same for every millwright
// cleaner). The zero value is valid. Retention: how long published rows are
// kept, default DefaultRetention, at least 1ms.
type CleanerConfig = cleaner.Config

// CleanStats reports one cleaning round: rows deleted, batches, and whether
// the round was skipped because another cleaner held the lock.
type CleanStats = cleaner.Stats

// cleanerTable deletes published rows by walking the primary key from the
// oldest row: old published rows sit at its start, so each batch reads
// little more than it deletes. Pending and failed rows are never deleted.
var cleanerTable = cleaner.Table{
	Component: "outbox", Rows: "published events",
	Store:            storage.OutboxRetention,
	DefaultRetention: DefaultRetention, MinRetention: time.Millisecond,
	Hint: cleaner.MissingTable("outbox.Migrations()"),
}

// Cleaner deletes published rows older than the retention period, in
// bounded batches. Run it beside every relay: a Postgres advisory lock
// lets one instance at a time clean (per schema); the others skip the
// round. Pending and failed rows are never deleted.
//
// On the partitioned layout (PartitionedMigrations) it deletes nothing: it
// creates CleanerConfig.PartitionsAhead days of partitions ahead and
// detaches and drops the partitions older than the retention (counted from
// created_at) that hold no pending or failed row, reporting the ones kept
// and the rows of the DEFAULT partition in CleanStats. It finds the layout
// at every round. See docs/partitioning.md.
//
// Its methods are every millwright cleaner's (internal/cleaner): Run,
// Close (drains, then cancels after CloseTimeout), Running, RunOnce and
// Count (the dry run).
type Cleaner = cleaner.Cleaner

// NewCleaner returns a cleaner of the outbox in db's search_path.
func NewCleaner(db postgres.DB, cfg CleanerConfig) (*Cleaner, error) {
	return cleaner.NewFrom(db, cleanerTable, cfg)
}
