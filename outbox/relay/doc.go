// Package relay publishes the outbox's committed events (package outbox
// writes them) to the broker through any Watermill publisher: a Relay
// beside the service, as many instances as you like.
//
//	r, err := relay.New(db, t.Publisher(), relay.Config{ListenURL: dbURL})
//	go r.Run(ctx)
//	defer r.Close() // lets the batch in flight finish
//
// # Relaying
//
// Run a Relay (and the outbox's cleaner, package retention) beside the service, as many instances as you
// like: they divide the work between them. Each row belongs to one of 64
// lanes, a hash of its aggregate; each running relay holds a share of the
// lanes (a lease in millwright_outbox_lanes, renewed while it runs) and
// publishes only those. Each round, a relay:
//
//  1. claims up to BatchSize due rows of its lanes, a share of each lane
//     first (in proportion to how densely the lane's rows lie in the
//     backlog, so a lane with a hot aggregate gets more of each batch),
//     each lane's in id order, with one read (no lock, no lease: no other
//     relay reads its lanes);
//  2. publishes them, with one PublishBatch call per topic when the
//     publisher has it (transport.BatchPublisher), the topics at once,
//     else with Publish, PublishConcurrency aggregates at a time;
//  3. marks the published rows with one UPDATE ... WHERE id = ANY(...), and
//     records failures with one more.
//
// A relay runs on a *sql.DB (lib/pq, or pgx's stdlib adapter) or a
// *pgxpool.Pool (New takes either); its statements are the storage
// layer's (internal/storage), one round trip each on both drivers.
//
// While it has a backlog, a relay does this for several groups of its
// lanes at once (Config.Workers batches in flight across the running
// relays), so that the database claims and marks while the broker
// publishes; each lane is in one group per round, so each aggregate stays
// in order.
//
// Relays that start or stop take or give up their share within a few
// tens of milliseconds; a relay that dies keeps its lanes until their lease
// (Config.Lease, default 30 s) runs out. outbox/DESIGN.md explains
// why this keeps order and how it scales.
//
// With Config.ListenURL set, an idle relay holds a wake-up lock (an
// advisory lock, on a connection of its own) and sleeps; while it does,
// every writing transaction NOTIFYs at commit, and while relays are busy
// none does: a NOTIFY in every transaction would serialise all commits of
// the database (NOTIFY holds a global lock through commit). Writers try
// the lock shared, without waiting, from the insert trigger; a relay takes
// it only once no writer holds it, so no event committed around the moment
// the relay went idle waits for the poll (see
// outbox/migrations/002_outbox_wakeup_lock.sql). A relay gives the lock back as
// soon as it has work, and a stopping relay hands it over (other idle
// relays wake and one takes it). A holder that stops answering loses it
// after 3 x PollInterval + 2 s (idle_session_timeout on its session,
// Postgres 14+), so a hung relay cannot leave writers notifying; until
// then, and after a holder crashes, the other relays fall back to
// PollInterval (default 1 s). Postgres refuses PREPARE TRANSACTION after a
// NOTIFY: services that write the outbox in two-phase transactions must
// run their relays without ListenURL (polling), so that no writer ever
// notifies. A relay with ListenURL uses two connections of its own besides
// its pool: the LISTEN and the wake-up lock, of the pool's driver (on a
// *pgxpool.Pool a pgx.Conn waiting in WaitForNotification, on a *sql.DB
// lib/pq's Listener), each connection attempt bounded by connect_timeout,
// reconnecting when lost, closed when Run ends. The channel is
// NotifyChannel(schema), within Postgres' 63 bytes for any schema name (a
// hash of the schema beyond 45 bytes; outbox/migrations/006_outbox_notify_channel_bound.sql).
//
// Upgrading to lanes (outbox/migrations/003_outbox_lanes.sql): stop the relays of
// the earlier version before starting these; the two kinds do not know of
// each other's claims. Lane lending (outbox/migrations/005_outbox_lane_lending.sql,
// see outbox/DESIGN.md): apply it, stop the relays of the version before, then
// start these; without it every round fails ("holding lanes (did
// `millwright migrate` run?)"). Run checks at start that the outbox's
// tables exist (millwright_outbox, millwright_outbox_lanes,
// millwright_outbox_relays) and returns an error naming the missing ones,
// the search_path and `millwright migrate` if they do not.
//
// # Publishing in the database
//
// When the broker is the outbox's own Postgres (the publisher is the sql
// transport's, a transport.InDatabasePublisher, and reaches the same
// database of the same running server, checked once), a relay publishes
// without reading the rows out: in one transaction it claims a batch of
// its lanes, marking it published, and copies it into each topic's
// watermill-sql table with INSERT ... SELECT, the metadata built in SQL
// exactly as the publisher path sends it (tested shape by shape). Publish
// and mark commit together: a relay killed at any point leaves both or
// neither, so relay crashes cause no duplicates. statement_timeout and
// idle_in_transaction_session_timeout bound each statement of that
// transaction and each pause between them to Lease. It commits with
// synchronous_commit off: a server crash may undo the last moves as a
// whole (their rows are published again), never one a consumer has
// acknowledged in this database, whose own commit flushes the WAL past it.
//
// A batch the database refuses (a topic table it cannot create, an id
// longer than watermill-sql's 36-character uuid column) goes through the
// publisher instead, with the per-row backoff below, and the relay
// publishes through the publisher for 30 s before trying the database
// again; a hand-written row whose metadata is not an object of strings
// also goes through the publisher, which logs it. Each row gets the
// relay's span when a tracer records (and rows with a stored trace context
// always), and the consumer's span is its child. Wrap the publisher (any
// decorator hides the interface) to keep the publisher path.
//
// # Guarantees
//
//   - A rolled-back transaction leaves no event; a committed one is
//     published at least once (when published in the database, relay
//     crashes repeat nothing; a server crash may repeat the last moves,
//     see above). A relay that dies at any point (even between publishing
//     and marking) leaves its rows pending; the relay that takes its lanes
//     (after Lease) publishes them again. Marks commit without waiting for
//     the WAL flush: a server crash may undo the last ones, and their rows
//     go out again. Consumers drop duplicates by metadata.EventID (package
//     idempotency).
//   - Per-aggregate order: all rows of an aggregate are in one lane, and
//     one relay at a time publishes a lane, in id order. Rows committed
//     later with a smaller id (concurrent writers of one aggregate) are
//     published when they become visible, so the order is commit order as
//     long as the writers of one aggregate are serialised, e.g. by locking
//     the aggregate's row, which a consistent aggregate needs anyway.
//     Different aggregates go in parallel, across relays and within one.
//   - Within a batch, nothing after a failed row of the same aggregate
//     counts as published, and no transport lets the broker have an
//     aggregate's row after one of it that failed in the same call (each
//     stops an ordering key at its first failure: see
//     transport.BatchPublisher): those rows go out again after it, so a
//     consumer that drops duplicates applies each aggregate in order even
//     when the broker refused part of a batch. A publisher of your own
//     must do the same: one whose Publish (or PublishBatch) lets a later
//     event of an aggregate through after an earlier one failed delivers
//     the later one first.
//   - A failing row backs off (Config.Retry, with jitter) and holds
//     back only its own aggregate, including events written after the
//     failure. Its retry budget is a duration, Retry.MaxElapsedTime
//     (default 15 minutes), counted from its first failure (the
//     first_failed_at column): it is retried until its first failure is
//     that old, whatever the jitter drew, and fails at the attempt made
//     then (MaxAttempts, if set, bounds it too; a failure.Permanent error
//     fails it at once). Then it becomes failed (counted in
//     millwright_outbox_failed_events), its aggregate moves on, and it
//     stays in the table until an operator runs `millwright outbox
//     retry-failed`, which also restarts its budget. No event is ever
//     dropped.
//   - With DeadLetterTopic set, a row that becomes failed is copied there
//     once: the copy is sent after the statement recording the failure
//     commits, so a statement that fails (its row is retried) sends none.
//     A relay that dies between the two, or a copy the broker refuses,
//     leaves the row failed without a copy (logged); the failed row, not
//     the copy, is what keeps the event.
//   - A panic does not end the relay: a broker call that panics is
//     recovered, logged with its rows and the stack, and counted
//     (outbox.MetricLoopPanics); the messages of a call of several are sent
//     again one at a time, and the row whose own call panics is failed at
//     once, its last_error naming the panic (for `millwright outbox
//     retry-failed` once the publisher is fixed). Its aggregate's later
//     rows go on as after any failed row. A panic elsewhere in a round
//     fails the round, retried as below.
//   - A relay that fails on its own (its database unreachable, the lane
//     check, the claim or the marks failing) retries after a backoff
//     doubling from 100 ms to 1 s (or a third of Lease, if shorter), drawn
//     with equal jitter, and logs the first failure, then at most one line
//     per 10 s with the count since, then one when it works again; it is
//     publishing again within about a second of its database answering.
//     This is not Config.Retry, which paces a failing row.
//   - Nothing of a batch outlasts the lease of the lanes it was claimed
//     under (Config.Lease): its publish is cut a tenth of Lease
//     before the lanes' lease ends, and broker calls not answered by then
//     leave their rows pending, as they were (no failure, no retry budget
//     spent), for whoever holds the lanes next; the marks write only rows
//     of lanes the relay still holds under a live lease, so a relay that
//     lost them marks nothing. A publisher whose call does not stop at its
//     messages' context (Kafka's Sarama waits out its own timeouts; the
//     AMQP publisher closing a channel waits for the broker) is left
//     running: while such a call runs, its relay holds no lanes (it frees
//     them and leaves), and the other relays publish them. Such a call may
//     still deliver its messages, before or while another relay publishes
//     them: duplicates, which a consumer drops. Lease should exceed the
//     slowest healthy round by far (a batch's publish gets about 0.4 x
//     Lease or more); a relay that stalls outside a publish (a paused VM) longer
//     than Lease loses its lanes and writes nothing of its batch.
//   - One aggregate goes no faster than one relay publishes: it is
//     ordered. A lane shares that limit with the aggregates hashed into
//     it.
//
// # Metrics
//
// With Config.Registerer set, the relay exports the Metric* constants:
// the backlog gauges (millwright_outbox_pending_events, millwright_outbox_oldest_pending_age_seconds,
// millwright_outbox_failed_events, refreshed every MetricsInterval from index-only
// queries), millwright_outbox_publish_latency_seconds and the published/failed
// counters. Package outboxtest waits for a drained outbox in tests.
package relay
