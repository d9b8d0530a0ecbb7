// Package cleaner is the one retention cleaner of every table millwright
// writes: published outbox rows (outbox.Cleaner), processed marks
// (idempotency.Cleaner), dead letters (dlq.Cleaner), finished saga
// instances and their steps (saga.Cleaner) and audit rows
// (audit.NewCleaner). A Table names the component and its default
// retention, and holds the storage layer's RetentionTable (the table, the
// predicate of the rows to delete, the lock, the partition mode: every SQL
// statement a cleaner runs is internal/storage's); Config the age, batch
// size, interval and close timeout.
//
// A cleaner runs on a storage.Pool: a *sql.DB (database/sql, lib/pq) or a
// *pgxpool.Pool (pgx v5), alike; the components' NewCleaner take either
// (NewCleaner(db postgres.DB, ...)). A round holds one connection of the pool
// (storage.Session) for its lock and its statements.
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
package cleaner
