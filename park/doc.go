// Package park retries failing messages without blocking their partition:
// a message that still fails after its in-place retries is parked in
// Postgres with its due time, its key's later messages are parked behind
// it in order, and the partition (or queue, or subscription) moves on with
// the other keys. A retrier retries parked keys with the policy's backoff
// and jitter, from any instance of the service, and after the budget
// writes the message to the DLQ; what then happens to the key's later
// messages is Config.OnDeadLetter (Hold, the default, or Continue).
//
// Watermill's Retry middleware retries in place (a 30-minute backoff holds
// the partition for 30 minutes, Watermill issue #271); its requeuer and
// delayed redelivery free the queue but give up per-key order. Park keeps
// both: only the failing key waits.
//
// # Wiring
//
//	parker, err := park.New(db, park.Config{ConsumerGroup: "billing", Registerer: reg})
//	rm, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{MaxAttempts: 3}})
//	dedup, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "billing"})
//	router.AddConsumerHandler("billing", "orders", sub, handle).
//		AddMiddleware(parker.Middleware("billing"), rm.Middleware, dedup.Middleware) // outermost first
//	go router.Run(ctx)
//	<-router.Running()  // the router has applied the middlewares: the handler is registered
//	go parker.Run(ctx)  // the retrier; Close it after the router
//	reg.MustRegister(park.NewCollector(park.NewStore(db)))
//
// The tables come from Migrations (`millwright migrate` applies them).
// `millwright parked list` shows parked keys; `millwright parked retry KEY`
// and `millwright parked release KEY` act on held ones, and `millwright
// parked skip KEY` dead-letters a retried head and goes on. Each is one
// function (RetryTx, ReleaseTx, SkipTx) that runs in the caller's
// transaction, so an operator tool adds its audit row to it; the Store's
// Retry, Release and Skip run them in a transaction of their own.
//
// # Middleware order
//
// park, then the in-place retry, then idempotency, then the handler:
//
//   - park outermost: it must check the key before anything runs, and it
//     decides on the final outcome of the in-place attempts. The retrier
//     runs the chain park wraps, so each round makes the in-place attempts
//     too (Config.Retry.MaxAttempts counts rounds).
//   - the in-place retry inside park absorbs blips (a deadlock, a dropped
//     connection) without a round trip through the table; keep it short
//     (a few attempts, milliseconds to seconds), since it does hold the
//     partition. Without it every failure parks at once.
//   - idempotency innermost, as with dlq: every attempt, first delivery or
//     round, goes through the deduplication. A message runs again when the
//     process dies between the handler's commit and the parked row's
//     removal, when its ack is lost after it was handled, or when its
//     retrier stops (dies, or stalls) past its lease; the dedup applies it
//     once.
//
// Do not wrap a parked handler in dlq.Middleware: park writes its own dead
// letters (below), and dlq around it would retry in place, then
// dead-letter, a message park nacked because the database was down.
//
// # Why the order holds
//
// The broker (or the key-parallel consumer) hands a key's messages to the
// middleware one at a time, in order. The key's row in
// millwright_parked_keys is its lock:
//
//   - Parking behind a key is one statement that locks the key's row
//     (SELECT ... FOR UPDATE) and inserts the message only if the row is
//     there; a failed message becomes a head with INSERT ... ON CONFLICT
//     DO UPDATE, which locks the row too.
//   - Releasing a key (the retrier after the last parked message
//     succeeded or, with Continue, was dead-lettered; `parked release`)
//     locks the row first, in its own statement, and decides "nothing left,
//     delete the key" in a later statement of the same transaction. Under
//     READ COMMITTED that statement's snapshot is taken after the lock, so
//     it sees every message parked before the lock was granted.
//
// So an arrival racing a release either locks first (its message is
// committed behind the key, the release sees it and makes it due) or
// second: it then finds the row gone, meaning every earlier message of
// the key is done, and runs the handler directly; or still there, and
// parks behind. A message's id is drawn while the row is locked, so a
// key's messages are in arrival order; the retrier runs only the lowest
// id of a key, one claim at a time (FOR UPDATE SKIP LOCKED, a lease, and
// a claim number that every write of the round checks).
// TestReleaseRacesArrival fails when the lock is removed.
//
// # Guarantees
//
//   - A message is acked when it succeeded, was parked, or was
//     dead-lettered; nacked (redelivered) when the database does not answer
//     or the in-place retry was interrupted by shutdown. A redelivered
//     message already parked is parked once (same handler and UUID).
//   - Parked keys are rows: they survive a restart and a rebalance. Any
//     instance whose Parker has the handler registered retries any parked
//     key of it; a retrier that dies mid-round leaves the key due again
//     after Config.Lease. While a round runs its retrier extends the claim
//     every third of the lease, so a live round, however long, is never
//     run again beside itself (with an idempotency mark written after
//     success, a second run would apply the head's effect after the key's
//     next message). Only a retrier that stops extending (dead, or stalled
//     past the lease) loses the key; its round's context is cancelled when
//     it notices, and only the newest claim's outcome is written.
//     TestRoundLongerThanLeaseRunsOnce.
//   - The first round comes after the policy's first jittered delay; each
//     failed round reschedules with the next. When Config.Retry is spent
//     (rounds, or MaxElapsedTime since the first failure), or a round fails
//     with failure.Permanent, the message is written to millwright_dead_letters
//     in the transaction that holds or advances its key, so `millwright dlq
//     list|show|replay` see it: handler, consumer group, reason, error, Go
//     type, stack, attempts (in place and rounds), first and last failure,
//     payload and metadata (the key among them). With Hold the key stays
//     parked, its head held, until `millwright parked retry` (head again,
//     then the rest, in order) or `release` (the head stays in the DLQ; the
//     rest goes on). With Continue the next message is due at once, and the
//     dead letter, replayed, lands after the key's later messages.
//   - A dead letter whose message is applied later through park (`parked
//     retry`, then a successful round) is resolved, in the transaction
//     that removes the message, with an audit row (dlq.ResolveTx): it
//     leaves `millwright dlq list --pending`, the console's dead ones and
//     millwright_dlq_depth_messages. TestDeadLetterAppliedThroughParkIsResolved.
//   - A dead letter replayed or edited (`millwright dlq replay`, the
//     console; the message carries metadata.DeadLetterReplayOf) while its
//     message is parked takes that message's place: the parked copy gets
//     the replay's payload and metadata, and when it is a held head the
//     hold is lifted and it is due at once with a fresh budget. It is
//     never acked as a redelivery of the parked copy. A replay whose
//     message is no longer parked runs (or parks behind its key) like any
//     message. TestReplayedDeadLetterOfHeldKeyIsApplied, and from the
//     consumer's side through the outbox, a relay and a broker in console's
//     TestConsoleEditReplayOfHeldKeyReachesTheConsumer. When the message
//     is its key's head and a retrier's round is running it right now
//     (after `millwright parked retry`, while the round's lease holds),
//     the replay writes nothing and is nacked ("its head is being retried
//     now; the replay is redelivered after the round"): the round could
//     apply the old payload and delete the edited copy with it. The
//     broker redelivers it; if the round failed, the head is still parked
//     and the replay takes its place; if the round applied the old
//     payload (and resolved the dead letter), the replay finds nothing
//     parked and runs as a new message, applying the edited payload after
//     the old one. A round whose retrier died (its lease passed) does not
//     block a replay. TestReplayWaitsForTheRunningRoundOfItsHead.
//   - A permanent error on first delivery is dead-lettered the same way at
//     once; with Hold the message becomes its key's held head.
//   - A message whose key is "" (Config.Key) is parked under its UUID:
//     alone, not ordered with other messages, in a lane no key shares
//     (whatever its text). TestKeylessLaneIsNotARealKey.
//   - Keys, UUIDs and metadata are stored as bytes: distinct keys (binary
//     Kafka keys that are not UTF-8 too) never share a lane, and a retried
//     message reaches its handler with byte-identical metadata.
//     TestBinaryKeysAndMetadataStayBytes. The dead letters park writes
//     keep the UUID and metadata bytes too (dlq migration 005); a replay
//     (through the outbox, whose metadata is text) refuses them, and
//     `millwright parked retry` runs the held head with every byte.
//     TestReplayOfBinaryKeyedDeadLetterKeepsItsBytes.
//   - No record kills the retrier: a round that panics (in
//     Config.Publish, in park, or in a handler no middleware inside park
//     recovered; the retry middleware turns a handler's panic into a
//     failed attempt first) or whose row does not decode is recovered,
//     logged with the record and its stack, counted (MetricSetAside) and
//     set aside: its key is held, the cause in its last error, for
//     `millwright parked retry` or `release --force`.
//     TestRetrierSurvivesPanicAndBadRow.
//   - Different keys never wait for each other; the middleware is safe for
//     concurrent use by handlers of different keys (a key-parallel
//     consumer). A parked key costs its partition nothing; every message
//     costs one statement (the parked check) on the database.
//   - A handler name belongs to one handler of a Parker: a second handler
//     wrapped under a taken name (or park's middleware added to the
//     router, which wraps every handler) is refused, not silently given
//     the first's parked keys: its messages are nacked with
//     ErrDuplicateHandler, which names the handler and the fix, and Run
//     returns it.
//   - Rounds run outside the Router: message.HandlerNameFromCtx and
//     SubscribeTopicFromCtx are empty there; Retried(ctx) reports a round.
//     Messages a round's handler returns go to Config.Publish (without it
//     the round fails permanently, saying so).
//
// Package park stores parked messages in Postgres for every transport
// kind; a broker's own delay feature (a delay topic) is not used.
package park
