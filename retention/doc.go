// Package retention keeps millwright's tables from growing forever: one
// Cleaner type deletes the rows of each table once they are old and no
// longer needed, with a constructor per table and its default age:
//
//   - NewOutboxCleaner: published outbox events (DefaultOutboxRetention, 7
//     days; on the partitioned layout it drops whole partitions);
//   - NewIdempotencyCleaner: processed marks (DefaultIdempotencyRetention,
//     7 days);
//   - NewDeadLetterCleaner: dead letters (DefaultDeadLetterRetention, 90
//     days);
//   - NewSagaCleaner: finished sagas with their steps
//     (DefaultSagaRetention, 30 days);
//   - NewAuditCleaner: the operators' audit trail (DefaultAuditRetention,
//     one year).
//
// Config sets the age, batch size, interval and close timeout, the same
// for every table:
//
//	c, err := retention.NewOutboxCleaner(postgres.From(pool), retention.Config{Logger: log})
//	go c.Run(ctx) // a round now, then every Config.Interval
//	defer c.Close()
//
// A cleaner runs on a postgres.DB: a *pgxpool.Pool (pgx v5) or a *sql.DB
// (database/sql, lib/pq), alike. A round holds one connection of the pool
// for its lock and its statements. Every SQL statement a cleaner runs is
// internal/storage's (the table, the predicate of the rows to delete, the
// lock, the partition mode). `millwright relay` runs every cleaner whose
// table exists; `millwright clean` runs one round on demand.
//
// Guarantees, for every table:
//
//   - Bounded batches: each DELETE removes at most BatchSize rows in its own
//     short transaction, skipping rows other sessions have locked, so
//     writers never wait on the cleaner and no huge WAL record is written.
//   - One instance at a time: a round holds a session advisory lock keyed
//     by the table and the schema; a cleaner that finds it taken skips the
//     round (Stats.Skipped), which is not a failure. Cleaners of different
//     schemas do not exclude each other.
//   - One lifecycle (internal/runner): Run cleans at once and then every
//     Interval; Close stops after the batch in flight, cancelling it after
//     CloseTimeout (a cancelled batch rolls back whole).
//   - A round of Run that panics is recovered, logged with the table and
//     the stack, counted (millwright_loop_panics_total, component
//     "<component>.Cleaner", on Config.Registerer) and retried at the next
//     interval, like a failed round: Run does not end with it.
//   - RunOnce is one round; Count is the dry run (how many rows RunOnce
//     would delete now), taking no lock.
package retention
