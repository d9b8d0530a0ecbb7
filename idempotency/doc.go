// Package idempotency makes a consumer apply each event's effect once even
// though every broker delivers at least once (redelivery after a crash, a
// nack, a rebalance, or a relay that published twice).
//
// A Middleware records (consumer, event id) in the millwright_processed_events
// table. In the default Transactional mode, for each message it begins a
// transaction, inserts the mark with ON CONFLICT DO NOTHING, and:
//
//   - if the mark already existed, the message is a duplicate: the handler is
//     skipped, the message is acked, and MetricDuplicates is incremented;
//   - otherwise the handler runs with the transaction in its message context
//     (TxFromContext: a postgres.Tx, whose SQL() or Pgx() is the
//     *sql.Tx or pgx.Tx of the store's driver). Its own writes through that transaction commit
//     atomically with the mark when it returns nil; when it returns an error
//     both roll back, so the redelivery runs it again.
//
// The mark is written before the handler runs, not checked with a SELECT
// first: a check-then-insert lets two concurrent deliveries both pass the
// check. With the insert first, the primary key makes a second delivery of
// the same event (on another instance, another connection) wait until the
// first transaction ends, then see the conflict.
//
// Example (apply Migrations() first, with `millwright migrate`):
//
//	store, _ := idempotency.NewPostgresStore(postgres.SQL(db)) // db: a *sql.DB
//	dedup, _ := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "billing"})
//	router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
//		tx, _ := idempotency.TxFromContext(msg.Context())
//		_, err := tx.SQL().ExecContext(msg.Context(), `UPDATE accounts SET ...`)
//		return err
//	}).AddMiddleware(dedup.Middleware)
//
// On pgx v5, give the store a *pgxpool.Pool (postgres.OpenPgx opens one
// with millwright's bounds); the same accessor gives the pgx.Tx:
//
//	pool, _ := postgres.OpenPgx(ctx, dsn)
//	store, _ := idempotency.NewPostgresStore(postgres.Pgx(pool))
//	...
//		tx, _ := idempotency.TxFromContext(msg.Context())
//		_, err := tx.Pgx().Exec(msg.Context(), `UPDATE accounts SET ...`)
//		// outbox.Add(msg.Context(), tx, events...) commits with the mark too
//
// A handler that returns messages (Watermill's produced messages, for
// Router.AddHandler) needs a destination for them in the Config: the
// middleware sends them itself, before the mark commits, and returns none
// to the router (see Produced messages below):
//
//	dedup, _ := idempotency.NewMiddleware(store, idempotency.Config{
//		Consumer: "billing", ProducedToOutbox: true, ProducedTopic: "invoices",
//	})
//
// # Event id
//
// The id is the metadata.EventID ("ce_id") value the outbox writes, else the
// result of Config.KeyFunc (KeyFromUUID uses Watermill's message UUID). A
// message with neither fails with an error wrapping ErrNoEventID, marked
// failure.Permanent: it is not processed and not acked, so it reaches the
// dead-letter path with that reason instead of being processed twice or
// dropped.
//
// # Guarantees
//
// Transactional mode: effects written through TxFromContext's transaction
// happen exactly
// once per (consumer, event id) within the retention period. Anything else
// the handler does outside that transaction (an HTTP call) is at least
// once. The transaction runs at READ COMMITTED and holds one connection and
// the mark's row lock for the handler's duration, so keep handlers short.
// Should the consumer's host vanish meanwhile without a reset (a frozen VM,
// a power loss, a partition, a dropped NAT entry), the server keeps that
// transaction, and every redelivery of the event fails with ErrMarkLocked,
// until TCP tells it the peer is gone: on a pool of postgres.Open or
// postgres.OpenPgx, whose sessions set tcp_keepalives_idle 30 s, _interval
// 10 s, _count 3 and tcp_user_timeout 60 s, within about a minute; on a
// pool opened otherwise, with Linux's defaults, 2 h 11 min (set those
// settings in its DSN, e.g. options=-c tcp_keepalives_idle=30 ...).
// Behind a connection pooler (PgBouncer) the server's peer is the pooler:
// its own client keepalives set the bound.
//
// MarkAfterSuccess mode, for effects outside the database: the middleware
// checks for a mark, runs the handler with no transaction held, then writes
// the mark. The effect repeats, honestly, when:
//
//   - the process dies, or the mark's insert or commit fails, after the
//     effect and before the mark commits: the redelivery runs the effect
//     again;
//   - two deliveries of one event run at the same time (a rebalance, a
//     redelivery after an ack timeout): both pass the check. The second to
//     finish finds the mark and increments MetricRepeatedEffects, with an
//     error log.
//
// Make such effects idempotent downstream too (send the event id as the
// HTTP Idempotency-Key). The window is the effect's duration plus one
// insert, against the whole handler for a consumer with no deduplication.
//
// Marks are scoped by Config.Consumer: two consumers of one event each
// process it once. A redelivery later than the retention period is
// processed again.
//
// # Produced messages
//
// Messages the handler returns are never lost: the middleware sends them
// before the mark commits, and never hands them to Watermill's router,
// which would publish them only after the commit (when that publish failed,
// the redelivery would be skipped as a duplicate and the follow-ups would
// be gone). Where they go:
//
//   - Config.ProducedToOutbox (PostgresStore, on either driver): written to
//     the outbox in the unit of work that holds the mark (its *sql.Tx or
//     pgx.Tx), and published by an outbox relay,
//     at least once, with the outbox's guarantees (package outbox). In
//     Transactional mode that is the handler's transaction: effects, mark
//     and follow-ups commit together or not at all, so each event's
//     follow-ups are written exactly once. In MarkAfterSuccess mode it is
//     the mark's own transaction: follow-ups and mark commit together; when
//     two deliveries ran at once, only the first to mark writes its
//     follow-ups. The strongest form; prefer it.
//   - Config.ProducedPublisher (any store): published before the mark
//     commits. A failed publish fails the message with no mark (in
//     Transactional mode the handler's effects roll back with it), and the
//     redelivery runs the handler again and publishes again: follow-ups
//     are at least once, never lost, and a copy also goes out when the
//     commit fails after the publish. A message without metadata.EventID
//     gets one derived from the consumer, the event id and its index, so a
//     run that returns the same messages in the same order gives each copy
//     the same id, and a downstream idempotency middleware drops it. In MarkAfterSuccess mode the handler's external effect
//     repeats with the run, as for a failed mark.
//   - neither: a handler that returns messages fails with
//     ErrNoProducedDestination (failure.Permanent, no mark, effects rolled
//     back in Transactional mode), so the dead-letter path parks the
//     message with the fields to set; replay it after the fix. In
//     MarkAfterSuccess mode the external effect has happened by then, and
//     the replay repeats it (as does every redelivery when no dead-letter
//     middleware parks the message: configure the destination before
//     deploying such a handler).
//
// The topic is Config.ProducedTopic, else the router handler's publish
// topic (Router.AddHandler's). Handlers that return no messages need none
// of this; writing follow-ups with outbox.Add in TxFromContext's
// transaction in the handler gives the same guarantee as ProducedToOutbox, with a topic per
// event.
//
// # Retention
//
// retention.NewIdempotencyCleaner's cleaner deletes marks older than
// retention.Config.Retention (default 7 days), BatchSize rows per statement, each statement its own transaction
// skipping rows locked by others, so consumers never wait on it. Run one in
// every consumer process: a per-schema advisory lock lets one work at a time
// and the others skip. Close lets the batch in flight finish, cancelling it
// after retention.Config.CloseTimeout (default 30s). `millwright idempotency
// clean --dry-run` shows what a round would delete.
//
// Sizing: rows = events/s x retention, per consumer. With a 20-character
// consumer name and UUID event ids a row costs about 220 bytes on disk,
// both indexes included (measured on Postgres 15): 100 events/s kept 7 days
// is 60 million rows, about 13 GB. The cleaner must delete events/s x
// Interval rows per run; here a batch of 1,000 rows takes about 6 ms, so the
// defaults (1,000 rows per batch, every minute) keep up with well over
// 10,000 events/s. Shorten Retention rather than let the table grow past
// what redeliveries need: broker retention plus the longest replay.
//
// # Stores
//
// PostgresStore is the production store, on a *sql.DB (lib/pq, or pgx's
// stdlib adapter) or a *pgxpool.Pool; its SQL lives in millwright's storage
// layer, with one implementation per driver. MemoryStore keeps marks in memory
// with the same transactional behaviour, for unit tests of handlers. Both
// pass the shared suite idempotencytest.Exercise, and both implement the
// optional Marker (one mark in a unit of work of its own), which
// MarkAfterSuccess mode uses when present.
//
// # Cost
//
// Transactional mode adds one statement to the handler's transaction. On a
// *pgxpool.Pool, and on a pool opened with postgres.Open (package
// github.com/millwright/millwright/postgres; millwright's own tools open
// theirs so), the Postgres store sends it with BEGIN, adding no round trip
// (PostgresStore.BeginMark); on any other *sql.DB it costs one round trip
// of its own. A duplicate ends that transaction on the server (the mark's
// row count is checked there), so skipping it costs the ROLLBACK's round
// trip, as before. MarkAfterSuccess mode's mark is one round trip on
// either driver (the lock timeout and the insert in one batch). `millwright-bench
// idempotency` compares a handler inserting one row with and without the
// middleware.
package idempotency
