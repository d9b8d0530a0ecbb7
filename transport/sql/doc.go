// Package sql is millwright's Postgres transport, built on watermill-sql
// (lib/pq). Applications reach it through package transport.
//
// Each topic is a table; each consumer group keeps its own offset per topic
// and reads messages in offset order, acking one batch at a time, so a
// group sees a topic in publish order (across commits, watermill-sql orders
// by transaction id). A nack rolls back and the message is redelivered.
// Messages persist until the table is truncated by the operator.
//
// Where it falls short: throughput is that of one Postgres; every consumer
// group polls (PollInterval, default 100ms); topic names become table names
// and must match [A-Za-z0-9_.:$-] (watermill-sql refuses others).
// Consumers read only rows below the server's xmin horizon, so one long
// transaction that has written, anywhere on the server (any database, any
// client), stops every consumer of every topic until it ends: the
// transport checks the horizon (HorizonCheckInterval), exports its age
// (MetricHorizonAge) and the holder's pid, and logs the blocking pid when
// committed rows wait behind it (see Horizon and docs/runbooks.md).
//
// CloudEvents: there is no protocol binding for SQL tables; the row's JSON
// metadata keeps the metadata.Event* keys ("ce_id", ...) as they are.
//
// The publisher is a transport.InDatabasePublisher: an outbox relay on the
// same database publishes a batch with one INSERT ... SELECT in the
// transaction that marks it published (see package outbox).
package sql
