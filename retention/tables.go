package retention

import (
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Each table's default Config.Retention.
const (
	// DefaultOutboxRetention: published outbox events are kept 7 days, for
	// audits and replays.
	DefaultOutboxRetention = 7 * 24 * time.Hour
	// DefaultIdempotencyRetention: processed marks are kept 7 days; a
	// redelivery later than this is processed again. Seven days covers
	// broker retention and replays after most incidents.
	DefaultIdempotencyRetention = 7 * 24 * time.Hour
	// DefaultDeadLetterRetention: dead letters are kept 90 days. The depth
	// alert fires within minutes of a dead letter, so a dead letter this
	// old has either been replayed or been judged not worth replaying.
	DefaultDeadLetterRetention = 90 * 24 * time.Hour
	// DefaultSagaRetention: finished (completed or compensated) sagas are
	// kept 30 days, long enough to look one up after a customer asks and
	// for any late reply to arrive.
	DefaultSagaRetention = 30 * 24 * time.Hour
	// DefaultAuditRetention: audit rows are kept one year, the span most
	// audit policies ask for.
	DefaultAuditRetention = 365 * 24 * time.Hour
)

// outboxTable deletes published rows by walking the primary key from the
// oldest row: old published rows sit at its start, so each batch reads
// little more than it deletes. Pending and failed rows are never deleted.
var outboxTable = table{
	Component: "outbox", Name: "Outbox", Rows: "published events",
	Store:            storage.OutboxRetention,
	DefaultRetention: DefaultOutboxRetention, MinRetention: time.Millisecond,
	Hint: missingTable("outbox.Migrations()"),
}

// NewOutboxCleaner returns a cleaner of the outbox (millwright_outbox) in
// db's search_path: it deletes published rows older than cfg.Retention
// (default DefaultOutboxRetention, at least 1ms). Pending and failed rows
// are never deleted. Run it beside every relay: one instance at a time
// cleans (per schema); the others skip the round.
//
// On the partitioned layout (outbox.PartitionedMigrations) it deletes
// nothing: it creates cfg.PartitionsAhead days of partitions ahead and
// detaches and drops the partitions older than the retention (counted from
// created_at) that hold no pending or failed row, reporting the ones kept
// and the rows of the DEFAULT partition in Stats. It finds the layout at
// every round. See docs/partitioning.md.
func NewOutboxCleaner(db postgres.DB, cfg Config) (*Cleaner, error) {
	return newCleaner(db, outboxTable, cfg)
}

// idempotencyTable deletes by ctid: the table's key is (consumer,
// event_id), and a ctid IN (...) delete is a TID scan. Rows a consumer has
// locked (a mark being written) are skipped, so consumers never wait.
var idempotencyTable = table{
	Component: "idempotency", Name: "Idempotency", Rows: "processed marks",
	Store:            storage.IdempotencyRetention,
	DefaultRetention: DefaultIdempotencyRetention, MinRetention: time.Minute,
	Hint: missingTable("idempotency.Migrations()"),
}

// NewIdempotencyCleaner returns a cleaner of the processed marks
// (millwright_processed_events) in db's search_path: marks older than
// cfg.Retention (default DefaultIdempotencyRetention, at least one minute:
// marks must outlive redeliveries) are deleted. Run one in every consumer
// process: one of them works while the others skip.
func NewIdempotencyCleaner(db postgres.DB, cfg Config) (*Cleaner, error) {
	return newCleaner(db, idempotencyTable, cfg)
}

var deadLetterTable = table{
	Component: "dlq", Name: "DeadLetter", Rows: "dead letters",
	Store:            storage.DLQRetention,
	DefaultRetention: DefaultDeadLetterRetention, MinRetention: time.Hour,
	Hint: missingTable("dlq.Migrations()"),
}

// NewDeadLetterCleaner returns a cleaner of the dead letters
// (millwright_dead_letters) in db's search_path: dead letters recorded
// longer ago than cfg.Retention (default DefaultDeadLetterRetention, at
// least one hour), replayed or not, are deleted. `millwright dlq clean
// --dry-run` shows how many a round would delete.
func NewDeadLetterCleaner(db postgres.DB, cfg Config) (*Cleaner, error) {
	return newCleaner(db, deadLetterTable, cfg)
}

var sagaTable = table{
	Component: "saga", Name: "Saga", Rows: "finished sagas",
	Store:            storage.SagaRetention,
	DefaultRetention: DefaultSagaRetention, MinRetention: time.Minute,
	Hint: missingTable("saga.Migrations()"),
}

// NewSagaCleaner returns a cleaner of the saga tables in db's search_path,
// for every saga type: completed and compensated sagas whose last
// transition is older than cfg.Retention (default DefaultSagaRetention, at
// least one minute) are deleted with their step history (the foreign key
// cascades; Stats.Deleted and BatchSize count sagas). Running,
// compensating and stuck sagas are never deleted. A reply that arrives for
// a deleted saga fails permanently with saga.ErrNotFound.
func NewSagaCleaner(db postgres.DB, cfg Config) (*Cleaner, error) {
	return newCleaner(db, sagaTable, cfg)
}

var auditTable = table{
	Component: "audit", Name: "Audit", Rows: "audit rows",
	Store: storage.AuditRetention,
	// A day at least: a trail that forgets yesterday is no trail.
	DefaultRetention: DefaultAuditRetention, MinRetention: 24 * time.Hour,
	Hint: missingTable("audit.Migrations()"),
}

// NewAuditCleaner returns a cleaner of the operators' audit trail
// (millwright_audit, written by the console and the CLI) in db's
// search_path: rows older than cfg.Retention (default
// DefaultAuditRetention, at least 24h) are deleted.
func NewAuditCleaner(db postgres.DB, cfg Config) (*Cleaner, error) {
	return newCleaner(db, auditTable, cfg)
}
