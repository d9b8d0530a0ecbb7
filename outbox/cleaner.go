package outbox

import (
	"context"
	"database/sql"
	"time"

	"github.com/millwright/millwright/internal/cleaner"
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
	Component: "outbox", Name: "millwright_outbox", Rows: "published events",
	Key: "id", OrderBy: "id",
	Where:            `status = 'published' AND published_at < now() - $1 * interval '1 millisecond'`,
	LockClass:        0x6d774f43, // "mwOC"
	DefaultRetention: DefaultRetention, MinRetention: time.Millisecond,
	Hint: cleaner.MissingTable("outbox.Migrations()"),
	// The partitioned layout (PartitionedMigrations): whole partitions are
	// dropped instead, never one holding a pending or failed row.
	Partitions: &cleaner.Partitions{Keep: []string{"status = 'pending'", "status = 'failed'"}, With: "fillfactor = 70"},
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
type Cleaner struct{ c *cleaner.Cleaner }

// NewCleaner returns a cleaner of the outbox in db's search_path.
func NewCleaner(db *sql.DB, cfg CleanerConfig) (*Cleaner, error) {
	c, err := cleaner.New(db, cleanerTable, cfg)
	if err != nil {
		return nil, err
	}
	return &Cleaner{c}, nil
}

// Running is closed once Run has started.
func (c *Cleaner) Running() <-chan struct{} { return c.c.Running() }

// Run cleans at once and then every Interval until ctx is done or Close is
// called; it then returns nil. A failed round is logged and retried at the
// next interval.
func (c *Cleaner) Run(ctx context.Context) error { return c.c.Run(ctx) }

// Close stops Run after the batch in flight (cancelling it after
// CloseTimeout) and waits for Run to return. It is idempotent.
func (c *Cleaner) Close() error { return c.c.Close() }

// RunOnce deletes, in batches of BatchSize, the rows published before now
// minus Retention, unless another cleaner of this outbox holds the lock
// (CleanStats.Skipped).
func (c *Cleaner) RunOnce(ctx context.Context) (CleanStats, error) { return c.c.RunOnce(ctx) }

// Count returns how many rows RunOnce would delete now, without deleting
// or locking anything (a dry run).
func (c *Cleaner) Count(ctx context.Context) (int64, error) { return c.c.Count(ctx) }
