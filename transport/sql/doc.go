// Package sql is millwright's Postgres transport, built on watermill-sql
// (lib/pq). Applications reach it through package transport.
//
// Each topic is a table; each consumer group keeps its own offset per topic
// and reads messages in offset order, acking one batch at a time, so a
// group sees a topic in publish order (across commits, watermill-sql orders
// by transaction id). A nack rolls back and the message is redelivered.
// Messages persist until the table is truncated by the operator.
//
// Wake-up: each messages table has a statement-level trigger that NOTIFYs
// at the commit of every inserting transaction (any writer: this
// publisher, watermill-sql's publisher on a user's transaction, the
// outbox relay's in-database insert; nothing on rollback). The transport
// LISTENs on one connection of its own (ListenURL, default URL) and a
// subscriber queries as soon as its table is notified, so commit-to-consume
// latency is the database's, not PollInterval. The poll stays as the
// fallback: a notification lost while the LISTEN connection is down (it
// reconnects, backing off up to 10s) costs at most one PollInterval, and a
// transport given DB without ListenURL only polls. A row notified while an
// older transaction still runs is not readable yet (below); the subscriber
// re-reads the horizon (every eighth of its wait so far, 1ms up to
// PollInterval) until it has passed the notified transaction, so the row
// is not left to the poll.
//
// The trigger's cost is on the write path: Postgres serializes the commits
// of notifying transactions (a lock held through the commit's WAL flush),
// so many concurrent one-message publishers commit one at a time (pgbench,
// 4 clients inserting one row per transaction: 1.6x to 3.5x fewer
// commits/s than without the trigger in three runs on a loaded 2-core
// machine: 675 against 190, 7,013 against 3,642, 4,898 against 3,039).
// Notifying only while a consumer waits (the outbox's wake-up lock) would
// remove most of it (1.2x to 1.6x more commits than always notifying, in
// a prototype not merged: it lost a wake-up under parallel -race load). A batch (PublishBatch, the outbox relay) pays
// it once per batch. Where that matters, set ListenURL to "-": tables this
// transport creates get no trigger, and subscribers poll (drop an existing
// trigger with DROP TRIGGER millwright_notify ON watermill_<topic>).
//
// Where it falls short: throughput is that of one Postgres; topic names
// become table names and must match [A-Za-z0-9_.:$-] (watermill-sql
// refuses others).
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
