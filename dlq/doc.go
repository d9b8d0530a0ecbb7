// Package dlq parks messages that keep failing on a dead-letter topic, with
// everything needed to understand and replay them, so that a poison message
// neither blocks its queue nor vanishes.
//
// # One middleware
//
// NewMiddleware is the one composition of panic recovery, retry and
// dead-lettering, stacked in the only order that works:
//
//	recover -> dead-letter -> retry (recovering each attempt) -> handler
//
// Use it instead of Watermill's Retry, Recoverer and PoisonQueue (Watermill
// issue #580 shows how easily those are stacked wrongly):
//
//	mw, err := dlq.NewMiddleware(publisher, dlq.Config{
//		ConsumerGroup: "billing",
//		Retry:         retry.Policy{InitialInterval: 500 * time.Millisecond, MaxAttempts: 5},
//		Logger:        logger,
//		Registerer:    prometheus.DefaultRegisterer,
//	})
//	if err != nil { ... }
//	router.AddMiddleware(mw.Middleware)
//
// Put it outside the idempotency middleware, so each attempt goes through
// the deduplication and a replayed dead letter is processed at most once:
//
//	handler.AddMiddleware(mw.Middleware, dedup.Middleware) // outermost first
//
// Handlers return failure.Permanent(err) for errors retrying cannot fix, and
// Malformed(err) (or DecodeJSON's error) for payloads they cannot read: both
// go to the dead-letter topic after one attempt.
//
// # Guarantees
//
//   - A message is acked only when its handler succeeded or when it was
//     published to its dead-letter topic. If that publish fails, or gives
//     no answer within Config.PublishTimeout (30s by default: a broker that
//     stopped confirming), the handler error is returned and the router
//     nacks the message for redelivery (MetricPublishFailures counts it).
//     A publish given up on may still reach the topic later, beside the
//     redelivery's own dead letter; both carry the original message's UUID
//     (metadata.DeadLetterOriginalMessageID), so the two are recognisable
//     as one message's.
//   - Whether a published dead letter reaches a recorder that starts later
//     depends on the transport:
//     amqp: by default a publish no queue is bound for fails
//     (amqp.ErrUnroutable), so while the dead-letter topic has no queue
//     the original is nacked, redelivered, retried and dead-lettered again,
//     until the recorder subscribes; with amqp.Config.AllowUnroutable
//     RabbitMQ drops such a dead letter. A queue bound later gets only
//     later dead letters, so another group's queue alone does not keep
//     them for the recorder.
//     googlecloud: the same, with googlecloud.ErrNoSubscription for a
//     topic without any subscription, and googlecloud.Config.AllowUnreceived
//     to drop instead; a subscription gets only messages published after
//     it exists.
//     kafka: the topic keeps it for its retention; a recorder group that
//     starts later reads it (InitialOffset "oldest", the default; "newest"
//     skips it).
//     sql: the row stays; a new consumer group reads the topic from the
//     start.
//     gochannel: kept in memory and replayed to a later subscriber in the
//     same process (the default persistent mode); with NotPersistent it is
//     dropped, and nothing survives the process.
//     So start the recorder (subscribe it to the dead-letter topics) before
//     the services whose dead letters it stores, as examples/orders does;
//     on amqp and googlecloud a poison message otherwise cycles through
//     its retries until it does (TestDeadLetterWaitsForItsRecorderAllTransports).
//   - It is dead-lettered when the retry policy is exhausted or the error is
//     permanent. When the message's context ends mid-backoff (shutdown), it
//     is nacked instead, for redelivery.
//   - The dead letter has the original payload, UUID and metadata (trace
//     context included) plus the metadata.DeadLetter* keys: original topic,
//     dead-letter topic, consumer group, handler, reason, error text and Go
//     type, panic stack, attempt count, first and last failure time and
//     original message id. Error and stack are cut to Config.MaxValueBytes
//     (1 KiB by default, the Pub/Sub attribute limit).
//   - One Error-level log line per dead letter names the message UUID, the
//     topic and the error. Counters MetricDeadLetters and
//     retry.MetricRetries are labelled by topic and reason.
//   - A dead letter consumed from its own dead-letter topic (by the
//     recorder) is never dead-lettered again: when its handler gives up it
//     is nacked and stays on the dead-letter topic.
//   - Config.Retry must be bounded (MaxAttempts or MaxElapsedTime): an
//     unbounded policy is rejected, since it would block the queue forever.
//   - A poison message does not stop the messages behind it: it holds its
//     consumer only for its retries (dlqtest.TestPoisonDoesNotBlock checks
//     this against any transport).
//
// # Inspection and replay
//
// Dead letters are stored in Postgres (table millwright_dead_letters, see
// Migrations) by a Store consuming the dead-letter topics:
//
//	store := dlq.NewStore(db) // a *sql.DB or a *pgxpool.Pool
//	router.AddConsumerHandler("dlq-recorder", "orders.dlq", subscriber, store.Record)
//
// The Store runs on database/sql (lib/pq, or pgx's stdlib adapter) or on a
// pgx v5 pool alike; its SQL lives in millwright's storage layer, one
// implementation per driver. A nil pool gives a Store whose every call
// fails saying so.
//
// The middleware does not write the table itself: the dead-letter publish is
// the single durable step that decides the ack, and a second write in the
// handler's path would be a dual write that can disagree with it. Record is
// idempotent, so redelivered dead letters are stored once.
//
// Every row of the table is written by one function, whatever gave up on
// the message: Store.Record stores what reaches a dead-letter topic (the
// middleware's dead letters, and the outbox relay's copies of events it
// could not publish), and package park, which holds a key behind its dead
// letter, writes it with RecordTx in the transaction that holds the key.
// Both fill every column the same way (TestRecordTxWritesLikeTheRecorder).
//
// A message's UUID, payload and metadata are stored byte for byte (a Kafka
// key or header is bytes, not text): DeadLetter.MessageUUID and Metadata
// read them back. Searches and the console's groups read text columns
// beside them, where bytes that are not UTF-8 show as U+FFFD; `millwright
// dlq list|show` and the console print such a UUID, key or value quoted
// ("\n\xff\x01\x00"). (A row recorded before migration 005 has what its
// text kept.)
//
// Store.List and Store.Get inspect them (List, Count, Get and Groups on a
// postgres.Handle: a DB, or the caller's transaction). Replay is one function whoever runs
// it: ReplayTx replays one dead letter in the caller's transaction (the
// operator console's, which edits too: ReplayOneOptions.Edit), and Replay
// runs it on each row a filter selects, at a bounded rate, with a dry run
// (`millwright dlq replay`). Each replay queues the message through the
// outbox (outbox.Add: the original event id, payload and metadata, or the
// edit), moves the row out of the dead state (StateReplayed, or
// StateSuperseded for an edited copy) and writes its audit row
// (ReplayCommand, by ReplayOptions.By), in one transaction: a relay then
// publishes it exactly once, and a second run skips it unless forced. A
// superseded row is never replayed again, not even forced. The outbox's
// metadata is text: a dead letter whose UUID or metadata is not
// (a binary key or header) is refused (ErrNotReplayable) rather than sent
// with other bytes; a key held by park is retried byte for byte by
// `millwright parked retry`.
//
// A dead letter written by package park whose message is applied later
// through park (`millwright parked retry`, or a replay that took its held
// head's place) becomes StateResolved by ResolveTx, in the transaction
// that removes the parked message, with a row in millwright_audit: it
// leaves Filter.Pending, Depth (millwright_dlq_depth_messages) and the
// console's dead ones, and Replay skips it unless forced. A replayed
// message carries metadata.DeadLetterReplayOf, by which park recognises
// it as its parked copy's replacement rather than a redelivery.
//
// # Who applies a replay
//
// A replay goes to the original topic, so every consumer group on it
// receives it, including the groups that applied the original. Their
// idempotency marks do not protect them: marks are kept 7 days
// (retention.DefaultIdempotencyRetention), dead letters 90, and a group without
// idempotency has none. So a replay names the consumer it is for:
// metadata.DeadLetterReplayFor = ReplayTarget(consumer group, handler),
// the pair the dead letter records, set by ReplayTx. The two middlewares that record dead letters check it
// before their handler, through one ReplayGate, with the very identity
// they record: this package's Middleware (Config.ConsumerGroup and the
// Watermill handler name) and park's Middleware (park.Config.ConsumerGroup
// and its handler name). A consumer they name otherwise acks the replay
// without running its handler, counted in MetricReplaysSkipped
// (Stats.ReplaysSkipped) and logged at info; the consumer that gave up
// applies it, once. So that replays are targeted, every consumer runs
// behind one of the two (as millwright's consumers do) and sets its
// ConsumerGroup: two services whose handlers share a name and leave the
// group empty are one consumer to a replay. A consumer group or handler
// renamed since no longer matches its old dead letters (every group would
// ack their replays unrun, each counting it): replay them with
// ReplayOptions.For set to the new name (`millwright dlq replay --for
// <group>/<handler>`).
//
// Replays that name no consumer go to every consumer of the topic, as
// before: a dead letter that records none (rows from before consumers
// were recorded, or from a middleware with neither a group nor a handler
// name), and a replay to another topic (ReplayOptions.Target: it is for
// whoever consumes that topic). ReplayItem.For says which; `millwright dlq
// replay` and the console's dry run warn before a replay every group runs.
// TestReplayIsAppliedOnlyByTheConsumerThatDeadLetteredIt and
// TestConsoleReplayIsAppliedOnlyByTheConsumerThatDeadLetteredIt (package
// console) check it from the consumers' tables.
//
// # Retention
//
// retention.NewDeadLetterCleaner's cleaner deletes dead letters recorded
// longer ago than retention.Config.Retention (default
// retention.DefaultDeadLetterRetention, 90 days; at least an hour), replayed or not, BatchSize rows per statement, one instance per
// schema at a time (an advisory lock; the others skip). The depth alert
// fires within minutes of a dead letter, so one this old has been replayed
// or judged not worth it. `millwright dlq clean --dry-run` (or `millwright
// clean --dry-run` for every table) shows what a round would delete.
package dlq
