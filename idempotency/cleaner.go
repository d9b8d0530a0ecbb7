package idempotency

import (
	"time"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// DefaultRetention is how long processed marks are kept by default: a
// redelivery later than this is processed again. Seven days covers broker
// retention and replays after most incidents.
const DefaultRetention = 7 * 24 * time.Hour

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
	Component: "idempotency", Rows: "processed marks",
	Store:            storage.IdempotencyRetention,
	DefaultRetention: DefaultRetention, MinRetention: time.Minute,
	Hint: cleaner.MissingTable("idempotency.Migrations()"),
}

// Cleaner removes processed marks older than the retention period from the
// Postgres table, in bounded batches, on one instance at a time. Run one in
// every consumer process: the advisory lock lets one of them work while the
// others skip.
// Its methods are every millwright cleaner's (internal/cleaner): Run,
// Close (drains, then cancels after CloseTimeout), Running, RunOnce and
// Count (the dry run).
type Cleaner = cleaner.Cleaner

// NewCleaner returns a cleaner of the millwright_processed_events table in
// db's search_path schema.
func NewCleaner(db postgres.DB, cfg CleanerConfig) (*Cleaner, error) {
	return cleaner.NewFrom(db, cleanerTable, cfg)
}
