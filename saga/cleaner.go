package saga

import (
	"time"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// DefaultRetention is how long a Cleaner keeps finished (completed or
// compensated) sagas by default: 30 days, long enough to look one up after
// a customer asks and for any late reply to arrive.
const DefaultRetention = 30 * 24 * time.Hour

// CleanerConfig configures a Cleaner (the same for every millwright
// cleaner). The zero value is valid. Retention: how long a finished saga
// is kept after its last transition, default DefaultRetention, at least
// one minute. BatchSize counts sagas; each takes its step history with it.
type CleanerConfig = cleaner.Config

// CleanStats reports one cleaning round: sagas deleted (their steps are not
// counted), batches, and whether the round was skipped because another
// cleaner held the lock.
type CleanStats = cleaner.Stats

var cleanerTable = cleaner.Table{
	Component: "saga", Rows: "finished sagas",
	Store:            storage.SagaRetention,
	DefaultRetention: DefaultRetention, MinRetention: time.Minute,
	Hint: cleaner.MissingTable("saga.Migrations()"),
}

// Cleaner deletes completed and compensated sagas whose last transition is
// older than the retention period, with their step history (the foreign
// key cascades), in bounded batches, on one instance at a time (per
// schema). Running, compensating and stuck sagas are never deleted. A reply
// that arrives for a deleted saga fails permanently with ErrNotFound.
// Its methods are every millwright cleaner's (internal/cleaner): Run,
// Close (drains, then cancels after CloseTimeout), Running, RunOnce and
// Count (the dry run).
type Cleaner = cleaner.Cleaner

// NewCleaner returns a cleaner of the saga tables in db's search_path, for
// every saga type.
func NewCleaner(db postgres.DB, cfg CleanerConfig) (*Cleaner, error) {
	return cleaner.NewFrom(db, cleanerTable, cfg)
}
