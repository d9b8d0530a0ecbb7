// Package outbox is the transactional outbox: a service writes its business
// rows and the events they cause in one Postgres transaction, and relays
// publish those events to the broker through any Watermill publisher.
//
// # Writing
//
// Add writes events in the caller's transaction, a postgres.Tx on either
// driver (postgres.SQLTx(*sql.Tx) or postgres.PgxTx(pgx.Tx)); passing a
// pool does not compile. AddOutsideTx writes them in a transaction of its
// own, for a producer with no business rows beside them. TxPublisher does the same behind Watermill's
// message.Publisher, so existing Watermill code, CQRS event buses included,
// gets the outbox by swapping its publisher for one bound to the
// transaction:
//
//	tx, _ := db.BeginTx(ctx, nil)
//	// ... business writes in tx ...
//	err := outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{
//		Topic: "orders", AggregateType: "order", AggregateID: order.ID,
//		EventType: "order.created.v1", Payload: payload,
//	})
//	err = tx.Commit()
//
// or with pgx:
//
//	tx, _ := pool.Begin(ctx) // pool: a *pgxpool.Pool
//	// ... business writes in tx ...
//	err := outbox.Add(ctx, postgres.PgxTx(tx), outbox.Event{...})
//	err = tx.Commit(ctx)
//
// Add sends its INSERT at once, one round trip on either driver, and
// returns its server error itself. With pgx, AddToBatch queues the INSERT
// in the pgx.Batch that carries the business statements instead, so the
// event costs the transaction no round trip of its own; the INSERT's
// server error then comes back with the batch's results, as for any
// statement of a pgx.Batch:
//
//	b := &pgx.Batch{}
//	b.Queue(`INSERT INTO orders (id) VALUES ($1)`, order.ID)
//	err := outbox.AddToBatch(ctx, b, outbox.Event{...}) // ErrInvalidEvent now
//	err = tx.SendBatch(ctx, b).Close()                   // the server's answer
//
// Every event gets a CloudEvents id (metadata.EventID, also the Watermill
// UUID), type, time and subject, the aggregate as metadata.OrderingKey, and
// the W3C traceparent of the OpenTelemetry span in ctx. Only what the row's
// columns do not already say (source, traceparent, the event's own
// Metadata) is stored in the metadata column; the relay derives the rest
// from the row when it publishes, and ce_time is created_at, the start of
// the writing transaction. (Upgrading from a version whose relays did not
// derive it: deploy relays first; see migrations/002_outbox_wakeup_lock.sql.)
// Valid JSON payloads go to the JSONB payload
// column (Postgres normalises whitespace and key order); other payloads, or
// any with Event.RawPayload, are kept byte for byte in payload_raw.
//
// Add refuses, with ErrInvalidEvent and in the caller's transaction, an
// event the relay could never publish: a NUL byte Postgres cannot store,
// metadata that is not UTF-8 text (the JSONB column would change its
// bytes, even merge two keys; the error names the key: headers are text,
// binary data goes in the payload or base64), metadata that does not make
// a valid CloudEvent, a topic the relay's
// transport refuses (transport.ErrInvalidName), and an event larger than
// the Writer's size limit as that transport counts it on the wire: payload, key and
// headers or attributes, with the CloudEvents metadata the relay adds
// (transport.ErrMessageTooLarge; the error names the size, the limit and
// the setting).
//
// Those limits, and the default CloudEvents source, belong to a Writer:
// build one at start-up from the relay's transport and write through it
// (Kafka: 1 MiB as Sarama counts it, or what kafka.Config.Tune sets;
// Pub/Sub: 10 MB and its attribute limits; RabbitMQ: 16 MiB of body; sql:
// 1 GiB and a 36-character id):
//
//	w, err := outbox.NewWriter(outbox.WriterConfig{Limits: t.Limits()}) // or transport.LimitsFor(cfg)
//	err = w.Add(ctx, postgres.PgxTx(tx), outbox.Event{...})
//
// The package-level Add, AddToBatch and a TxPublisher without
// PublisherConfig.Writer use the default Writer: names some kind takes,
// 1 MiB counted as Kafka counts it, the source "/" +
// $MILLWRIGHT_SERVICE_NAME. Nothing of this is process state: Writers
// with different settings live side by side. A broker whose limit is
// below its kind's default (a Kafka topic's max.message.bytes) is not
// known to a Writer: set WriterConfig.MaxEventBytes to it. What a broker still
// refuses for its size or name comes back from the kafka, googlecloud and
// sql publishers as a permanent error (failure.Permanent, wrapping
// transport.ErrMessageTooLarge or transport.ErrInvalidName).
//
// Cost: one INSERT statement per 1,000 events, one round trip, sent by Add
// itself on every driver and pool (database/sql: one simple query with the
// values inlined as quoted literals; pgx: one statement with its
// arguments). Every error of the INSERT, Add's own checks and the
// server's (a schema without the outbox table), is returned by Add; the
// server's leaves the transaction aborted, so nothing of it commits.
// `millwright-bench outbox --sections write`
// compares a one-row business transaction alone, with a plain second
// insert, and with one event.
//
// # Relaying
//
// Package outbox/relay publishes the committed rows (relay.New, beside the
// service, as many instances as you like), in order per aggregate, at
// least once; its doc states the guarantees. Package outbox/capture lets
// Debezium's connector relay them instead and switches between the two;
// package retention deletes published rows. A service that only writes
// events imports this package alone, and links neither.
//
// # Retention
//
// The outbox's cleaner, retention.NewOutboxCleaner (package retention
// holds every table's), deletes published rows older than Retention
// (default 7 days)
// in batches of BatchSize rows, each its own short transaction, under a
// per-schema advisory lock so one instance cleans at a time. Pending and
// failed rows are never deleted. Sizing: the table holds about
// rate x retention published rows, each about (payload + stored metadata
// + 250 bytes) / 0.7 on disk (fillfactor 70) plus 30 bytes of primary key:
// about 0.9 KB for a 300-byte JSON payload without metadata of its own.
// 200 events/s for 7 days is 121 million rows, about 110 GB; at such
// volumes shorten the retention or use daily partitions (below). The
// cleaner must delete at least the write
// rate: each round loops over batches until nothing old is left, each batch
// a DELETE by primary key from the oldest end of the table, so one instance
// keeps up with far higher rates than one relay publishes; shorten Interval
// if rounds grow long. The relay's claim reads only the
// partial indexes on pending rows, so its cost does not grow with the
// published rows (see `millwright-bench outbox`) once vacuum has removed
// their index entries: docs/partitioning.md gives the autovacuum settings
// for this table. For very large volumes, the partitioned layout
// (PartitionedMigrations, `millwright migrate --outbox-partitioned`)
// partitions the table by UTC day on created_at, and the same cleaner then
// creates partitions ahead and detaches and drops whole partitions older
// than the retention that hold no pending or failed row: no DELETE, nothing
// for vacuum. Add and the relay work unchanged on it; docs/partitioning.md
// tells how to convert a table that has rows.
package outbox
