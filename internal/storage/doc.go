// Package storage owns every SQL statement millwright runs on its own
// tables (migrations aside): the outbox, the idempotency marks, the saga
// instances, the dead letters, the audit log and their cleaners call typed
// operations of this package and never see SQL text, as river's domain
// code calls riverdriver.Executor.
//
// # Layers
//
// A driver says how statements travel; the operations say what they are.
//
//   - Querier, Pool and Tx are the driver's side, implemented once for
//     database/sql (lib/pq, or any database/sql driver for Postgres, pgx's
//     stdlib adapter included) and once for pgx v5 (pgx.Tx, *pgx.Conn,
//     *pgxpool.Pool). They run a Statement (SQL text with $n arguments),
//     a batch of statements, and transactions.
//   - The operations (InsertEvents, ClaimLanes, MarkProcessed, ...) build
//     Statements and scan rows through a Querier. Their SQL text is shared
//     by both drivers, as river's two drivers share theirs through sqlc;
//     what differs per driver is the wire, so the operations are written
//     once and the driver suite (storagetest.Exercise) runs them on both.
//
// # Round trips
//
// Each driver saves round trips its own way:
//
//   - pgx sends a statement's arguments with the extended protocol in one
//     round trip (its statement cache prepares each text once per
//     connection), and a Batch as one pgx.Batch: one round trip.
//   - database/sql with lib/pq needs two round trips for a statement with
//     arguments (parse, then bind and execute), so this driver inlines the
//     arguments as quoted literals (lib/pq's QuoteLiteral, libpq's
//     escaping) and sends one simple query; a Batch is one simple query of
//     the inlined statements.
//   - On both, TxOptions.First travels with BEGIN in one round trip.
//
// # Values
//
// Both drivers store an argument as one value (storagetest's "values"
// contract runs the extremes on each): a time.Time as its instant to the
// microsecond, whatever its year or offset (database/sql inlines it in UTC,
// years before 1 as BC, since Postgres reads neither Go's year 0 nor
// offsets beyond ±15:59); text and bytes as they are; a float32 as its
// exact value. What Postgres cannot store as it is (text with a NUL byte or
// invalid UTF-8, a time outside 4714-11-24 BC .. 294276 AD, an unsigned
// integer past bigint) is refused before anything is sent, on both
// drivers, with a *ValueError naming the statement and the argument; it
// matches ErrUnstorable and has the SQLSTATE the server gives the same
// refusal. IsDataError and Hint say an error's real cause: a refused
// value is not a missing migration.
//
// # Where errors surface
//
// On every driver, an operation's error is returned by the operation
// itself: nothing is held back until COMMIT. A Batch outside a
// transaction is atomic on both drivers (one implicit transaction); a
// statement of a batch that fails stops the batch and its error names
// the statement's position. A Statement with Expect set fails with a
// *ConflictError, on the server, when it does not affect exactly that
// many rows, so that the batch's later statements do not run on either
// driver.
package storage
