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
// transport given DB without ListenURL only polls.
//
// Both wake-up connections (the LISTEN, and the wake-up lock's below) are
// watched every WakeCheckInterval (default 5s): the LISTEN connection
// must answer a ping, and the lock's session, while it holds a lock, must
// show that it still holds it, each within WakeCheckInterval. Nothing
// else would notice a connection that the server ended while the
// consumers wait (idle_session_timeout, pg_terminate_backend, a proxy or
// pooler dropping an idle connection: the lock goes with it and writers
// stop notifying, the LISTEN being healthy) or that went silent (a
// dropped NAT entry, no RST: the LISTEN would wait for good). A lost
// connection is replaced, the locks taken again, and every waiting
// subscription queries once, so a committed row waits at most about
// 2 x WakeCheckInterval after such a loss (plus a reconnection while the
// server answers), or PollInterval if that is shorter; never the whole
// poll. A subscription whose own try of the lock fails tries again within
// a second. A silent connection's session lives on on the server with the
// locks it held (until TCP keepalive finds it, hours by default): the next
// lock connection ends it (pg_terminate_backend; another role's session
// needs pg_signal_backend), or writers would keep notifying. A row notified while an
// older transaction still runs is not readable yet (below); the subscriber
// re-reads the horizon (every eighth of its wait so far, 1ms up to
// PollInterval) until it has passed the notified transaction, so the row
// is not left to the poll.
//
// The trigger's cost is on the write path: Postgres serializes the commits
// of notifying transactions (a lock held through the commit's WAL flush).
// So writers notify only while a consumer waits, with the outbox's
// protocol (outbox/migrations/002): while its subscriptions on a table are
// idle, the transport holds that table's wake-up lock (advisory, key
// (1836544881 "mwsq", table oid)) exclusively on one connection of its own
// (on ListenURL's server, so it must allow session state: no transaction
// pooling); the trigger takes it shared without waiting and NOTIFYs only
// when it cannot. A woken subscription gives its share of the hold up
// before it queries, so writers stop notifying while consumers are busy.
// Before waiting again it takes the lock (without waiting) and then looks
// at the table in a statement of its own: rows its group can read give
// the lock up again and are queried at once (never handed over with the
// lock held), rows the horizon still hides are waited for as notified ones
// are. No wake-up is lost: every commit is either seen by that look or
// notifies a listener (the argument is in DESIGN.md; tests provoke each
// interleaving with hooks). While writers hold the lock shared the
// subscription queries again soon (1ms doubling up to 100ms or
// PollInterval). Several processes on one table: one holds the lock and
// the others rely on it, as the outbox's relays do: its writers'
// notifications reach every listener, and giving it back (when woken, at
// Close, after the listener reconnects) notifies a handover ("<oid> 0
// <pid>") that wakes them so one takes it; a holder that dies without it
// costs the others at most a second (a wait relying on another's hold
// takes the lock itself after one). While the LISTEN connection is down no
// lock is taken (the poll stays); after it reconnects the locks are taken
// again. Measured with scripts/sqlwakecost (4 writers, one row per
// transaction, commits/s, three rounds of one run on a 2-core machine
// loaded by other helpers, load average 260-1000): no trigger
// 2042/2492/3075, always notifying 1014/1545/1305, the lock-guarded
// trigger with no consumer waiting 1914/2883/2404 (1.89x/1.87x/1.84x the
// always-notifying one, 0.94x/1.16x/0.78x no trigger), with one waiting
// 1036/1150/937 (1.02x/0.74x/0.72x: it notifies, and takes the lock
// shared first). An earlier, quieter pgbench run of the reverted
// prototype: no trigger 7013/4898, always notifying 3642/3039,
// lock-guarded idle 5897/3568-4568.
// A batch (PublishBatch, the outbox
// relay) pays a notification once per batch. Upgrading: transports of
// this version replace the trigger function (the older one always
// notified); transports of the older version on a table with the new
// function are notified only while one of this version waits, and
// otherwise poll. Where the cost still matters, set ListenURL to "-":
// tables this transport creates get no trigger, and subscribers poll (drop
// an existing trigger with DROP TRIGGER millwright_notify ON
// watermill_<topic>).
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
