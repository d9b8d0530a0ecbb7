// Package migrate applies the versioned SQL migrations that each millwright
// component embeds (outbox, idempotency, dlq, saga, ...).
//
// A component ships its migrations as files named NNN_description.sql in an
// embedded file system. Up applies, per component, every version not yet
// recorded in the millwright_migrations table, each in its own transaction,
// while holding a Postgres advisory lock so that several processes starting
// at once apply each migration exactly once. Tables are created unqualified,
// so they land in the first schema of the connection's search_path that
// exists (current_schema()); tests use that to get an isolated schema each.
// When none of them exists Up creates nothing and returns a *NoSchemaError
// (errors.Is(err, ErrNoSchema)) naming the schema and the fix: create it, or
// connect with a search_path naming the schema to migrate.
package migrate
