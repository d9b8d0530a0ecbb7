// Package outbox is the transactional outbox: a service writes its business
// rows and the events they cause in one Postgres transaction, and relays
// publish those events to the broker through any Watermill publisher.
//
// # Writing
//
// Add writes events through the caller's transaction (any Executor: *sql.Tx,
// *sql.Conn, *sql.DB); TxPublisher does the same behind Watermill's
// message.Publisher, so existing Watermill code, CQRS event buses included,
// gets the outbox by swapping its publisher for one bound to the
// transaction:
//
//	tx, _ := db.BeginTx(ctx, nil)
//	// ... business writes in tx ...
//	err := outbox.Add(ctx, tx, outbox.Event{
//		Topic: "orders", AggregateType: "order", AggregateID: order.ID,
//		EventType: "order.created.v1", Payload: payload,
//	})
//	err = tx.Commit()
//
// Every event gets a CloudEvents id (metadata.EventID, also the Watermill
// UUID), type, time and subject, the aggregate as metadata.OrderingKey, and
// the W3C traceparent of the OpenTelemetry span in ctx. Only what the row's
// columns do not already say (source, traceparent, the event's own
// Metadata) is stored in the metadata column; the relay derives the rest
// from the row when it publishes, and ce_time is created_at, the start of
// the writing transaction. (Upgrading from a version whose relays did not
// derive it: deploy relays first; see migrations/002_outbox_wakeup_lock.sql.) Valid JSON payloads go to the JSONB payload
// column (Postgres normalises whitespace and key order); other payloads, or
// any with Event.RawPayload, are kept byte for byte in payload_raw. Nothing
// is rejected for its payload.
//
// Cost: one INSERT statement without parameters (one round trip with
// lib/pq) per 1,000 events. `millwright bench outbox --sections write`
// compares a one-row business transaction alone, with a plain second
// insert, and with one event.
//
// # Relaying
//
// Run a Relay (and a Cleaner) beside the service, as many instances as you
// like. Each round, a relay:
//
//  1. claims up to BatchSize rows in ONE autocommitted statement (UPDATE ...
//     RETURNING over a SELECT ... FOR UPDATE SKIP LOCKED) that also leases
//     them (next_attempt_at = now() + Lease). That is how the claim
//     transaction is bounded: it lasts one statement, a few milliseconds,
//     and no transaction is open while the broker is called; the lease,
//     not a lock, keeps other relays off the rows. The claim reads at most
//     4 x BatchSize due rows through the partial index on pending rows, so
//     its cost depends on neither the backlog nor the published rows;
//  2. publishes them, with one PublishBatch call per topic when the
//     publisher has it (transport.BatchPublisher), else with Publish,
//     PublishConcurrency aggregates at a time, while it already claims the
//     next batch;
//  3. marks the published rows with one UPDATE ... WHERE id = ANY(...), and
//     records failures with one more.
//
// With RelayConfig.ListenURL set, an idle relay holds a wake-up lock (an
// advisory lock, on a connection of its own) and sleeps; while it does,
// every writing transaction NOTIFYs at commit, and while relays are busy
// none does: a NOTIFY in every transaction would serialise all commits of
// the database (NOTIFY holds a global lock through commit). Writers try
// the lock shared, without waiting, from the insert trigger; a relay takes
// it only once no writer holds it, so no event committed around the moment
// the relay went idle waits for the poll (see
// migrations/002_outbox_wakeup_lock.sql). A relay gives the lock back as
// soon as it has work, and a stopping relay hands it over (other idle
// relays wake and one takes it). A holder that stops answering loses it
// after 3 x PollInterval + 2 s (idle_session_timeout on its session,
// Postgres 14+), so a hung relay cannot leave writers notifying; until
// then, and after a holder crashes, the other relays fall back to
// PollInterval (default 1 s). Postgres refuses PREPARE TRANSACTION after a
// NOTIFY: services that write the outbox in two-phase transactions must
// run their relays without ListenURL (polling), so that no writer ever
// notifies. A relay with ListenURL uses two connections of its own besides
// its *sql.DB: the LISTEN and the wake-up lock.
//
// # Publishing in the database
//
// When the broker is the outbox's own Postgres (the publisher is the sql
// transport's, a transport.InDatabasePublisher, and reaches the same
// database of the same running server, checked once), a relay publishes
// without reading the rows out: in one transaction it claims a batch,
// marking it published, and copies it into each topic's watermill-sql
// table with INSERT ... SELECT, the metadata built in SQL exactly as the
// publisher path sends it (tested shape by shape). Publish and mark commit
// together: a relay killed at any point leaves both or neither, so relay
// crashes cause no duplicates. The transaction is the batch's lease:
// statement_timeout and idle_in_transaction_session_timeout bound each of
// its statements and each pause between them to Lease, so a stalled relay
// loses its rows to the others. It commits with
// synchronous_commit off: a server crash may undo the last moves as a
// whole (their rows are published again), never one a consumer has
// acknowledged in this database, whose own commit flushes the WAL past it.
//
// Rows other relays are moving stay due until those commit, so a claim
// that finds only such rows looks again within 40 ms. While its batches
// come back full, a relay runs a second mover beside its loop (a move is
// all database work; two keep two database cores busy); the helper stops
// at the first batch that is not full, and after meeting other relays'
// batches waits 1 s before it starts again. A batch the database refuses
// (a topic table it cannot create, an id longer than watermill-sql's
// 36-character uuid column) goes through the publisher instead, with the
// per-row backoff below, and the relay publishes through the publisher for
// 30 s before trying the database again; a hand-written row whose metadata
// is not an object of strings also goes through the publisher, which logs
// it. Each row gets the relay's span when a tracer records (and rows with
// a stored trace context always), and the consumer's span is its child.
// Wrap the publisher (any decorator hides the interface) to keep the
// publisher path.
//
// # Guarantees
//
//   - A rolled-back transaction leaves no event; a committed one is
//     published at least once (when published in the database, relay
//     crashes repeat nothing; a server crash may repeat the last moves,
//     see above). A relay that dies at any point (even between
//     publishing and marking) leaves its rows leased; after Lease they are
//     claimed again and republished. Consumers drop duplicates by
//     metadata.EventID (package idempotency).
//   - Per-aggregate order: only the oldest pending row of an aggregate can
//     be claimed (with the rows after it), so one relay at a time holds an
//     aggregate and publishes its rows in id order. Rows committed later
//     with a smaller id (concurrent writers of one aggregate) are published
//     when they become visible, so the order is commit order as long as the
//     writers of one aggregate are serialised, e.g. by locking the
//     aggregate's row, which a consistent aggregate needs anyway. Different
//     aggregates go in parallel, across relays and within one.
//   - Within a batch, nothing after a failed row of the same aggregate counts
//     as published: those rows are released and republished after it, so a
//     consumer that drops duplicates sees each aggregate in order even when
//     a broker accepted part of a batch.
//   - A failing row backs off (RelayConfig.Retry, with jitter) and holds back
//     only its own aggregate. After the last attempt it becomes failed
//     (counted in outbox_failed_count; copied to DeadLetterTopic if set),
//     its aggregate moves on, and it stays in the table until an operator
//     runs `millwright outbox retry-failed`. No event is ever dropped.
//   - A claim looks at the oldest 4 x BatchSize due rows only. Followers
//     of failing rows are parked with them, so a failing aggregate never
//     hides others; but when one aggregate's backlog of more than that many
//     rows is being published by one relay, other relays see no work until
//     it shrinks (the aggregate itself cannot go faster: it is ordered).
//     Rows backing off are read and skipped on the way to the due ones:
//     when the whole backlog is backing off (a long broker outage), each
//     claim reads all of it (measured: 74 ms per claim at 200,000 pending
//     rows), once per PollInterval per relay, until rows fall due.
//   - Lease must exceed the slowest publish of a batch; if it does not,
//     another relay may republish rows still in flight (duplicates, never
//     loss or reordering after deduplication).
//
// # Retention
//
// A Cleaner deletes published rows older than Retention (default 7 days)
// in batches of BatchSize rows, each its own short transaction, under a
// per-schema advisory lock so one instance cleans at a time. Pending and
// failed rows are never deleted. Sizing: the table holds about
// rate x retention published rows, each about (payload + stored metadata
// + 250 bytes) / 0.7 on disk (fillfactor 70) plus 30 bytes of primary key:
// measured 0.9 KB for a 300-byte JSON payload without metadata of its own.
// 200 events/s for 7 days is 121 million rows, about 110 GB; at such
// volumes shorten the retention or use daily partitions (below). The cleaner must delete at least the write
// rate: each round loops over batches until nothing old is left, each batch
// a DELETE by primary key from the oldest end of the table, so one instance
// keeps up with far higher rates than one relay publishes; shorten Interval
// if rounds grow long. The relay's claim reads only the
// partial indexes on pending rows, so its cost does not grow with the
// published rows (see `millwright bench outbox`) once vacuum has removed
// their index entries: docs/partitioning.md gives the autovacuum settings
// for this table. For very large volumes, the partitioned layout
// (PartitionedMigrations, `millwright migrate --outbox-partitioned`)
// partitions the table by UTC day on created_at, and the same Cleaner then
// creates partitions ahead and detaches and drops whole partitions older
// than the retention that hold no pending or failed row: no DELETE, nothing
// for vacuum. Add and the Relay work unchanged on it; docs/partitioning.md
// tells how to convert a table that has rows.
//
// # Metrics
//
// With RelayConfig.Registerer set, the relay exports the Metric* constants:
// the backlog gauges (outbox_pending_count, outbox_oldest_pending_age_seconds,
// outbox_failed_count, refreshed every MetricsInterval from index-only
// queries), relay_publish_latency_seconds and the published/failed
// counters. Package outboxtest waits for a drained outbox in tests.
package outbox
