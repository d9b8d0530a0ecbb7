package idempotency

import (
	"context"
	"database/sql"
	"time"

	"github.com/millwright/millwright/internal/cleaner"
)

// DefaultRetention is how long processed marks are kept by default: a
// redelivery later than this is processed again. Seven days covers broker
// retention and replays after most incidents.
const DefaultRetention = 7 * 24 * time.Hour

// cleanerLockClass is the first key of the advisory lock the cleaner holds
// while deleting; the second is a hash of the schema, so cleaners of
// different schemas do not exclude each other.
const cleanerLockClass int32 = 0x6d775045 // "mwPE"

// CleanerConfig configures a Cleaner (the same for every millwright
// cleaner). The zero value is valid. Retention: how long marks are kept,
// default DefaultRetention, at least one minute (marks must outlive
// redeliveries).
type CleanerConfig = cleaner.Config

// CleanStats reports one cleaning round: marks deleted, batches, and
// whether the round was skipped because another cleaner held the lock.
type CleanStats = cleaner.Stats

// cleanerTable deletes by ctid: the table's key is (consumer, event_id),
// and a ctid IN (...) delete is a TID scan. Rows a consumer has locked
// (a mark being written) are skipped, so consumers never wait.
var cleanerTable = cleaner.Table{
	Component: "idempotency", Name: "millwright_processed_events", Rows: "processed marks",
	Key:              "ctid",
	Where:            `processed_at < now() - $1 * interval '1 millisecond'`,
	LockClass:        cleanerLockClass,
	DefaultRetention: DefaultRetention, MinRetention: time.Minute,
	Hint: cleaner.MissingTable("idempotency.Migrations()"),
}

// Cleaner removes processed marks older than the retention period from the
// Postgres table, in bounded batches, on one instance at a time. Run one in
// every consumer process: the advisory lock lets one of them work while the
// others skip.
type Cleaner struct{ c *cleaner.Cleaner }

// NewCleaner returns a cleaner of the millwright_processed_events table in
// db's search_path schema.
func NewCleaner(db *sql.DB, cfg CleanerConfig) (*Cleaner, error) {
	c, err := cleaner.New(db, cleanerTable, cfg)
	if err != nil {
		return nil, err
	}
	return &Cleaner{c}, nil
}

// Run cleans at once and then every Interval until ctx is done or Close is
// called; it then returns nil. A failed round is logged and retried at the
// next interval. Run may be called once; after Close it returns nil at once.
func (c *Cleaner) Run(ctx context.Context) error { return c.c.Run(ctx) }

// Running is closed once Run has started.
func (c *Cleaner) Running() <-chan struct{} { return c.c.Running() }

// Close stops Run after the batch in flight, cancelling it after
// CloseTimeout (a cancelled batch rolls back whole; the next round redoes
// it), and waits for Run to return. It is idempotent and safe to call when
// Run was never called.
func (c *Cleaner) Close() error { return c.c.Close() }

// Count returns how many marks RunOnce would delete now: those older than
// the retention period. It takes no lock and changes nothing (the operator
// CLI's dry run).
func (c *Cleaner) Count(ctx context.Context) (int64, error) { return c.c.Count(ctx) }

// RunOnce deletes every mark older than the retention period, BatchSize rows
// per statement, unless another cleaner of the same schema holds the lock
// (CleanStats.Skipped). Each batch is its own transaction and skips rows
// locked by others, so consumers never wait on the cleaner.
func (c *Cleaner) RunOnce(ctx context.Context) (CleanStats, error) { return c.c.RunOnce(ctx) }
