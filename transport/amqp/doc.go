// Package amqp is millwright's RabbitMQ transport. Applications reach it
// through package transport. Subscribers are watermill-amqp's, or with
// Config.KeyParallelism millwright's key-parallel KeyedSubscriber; the
// publisher is millwright's own, on amqp091-go (watermill-amqp v2.1.3's
// publisher leaks pooled channels while disconnected until every Publish
// blocks, and can panic on Close).
//
// Topology: each topic is a durable fanout exchange; each consumer group is a
// durable queue named "<topic>_<group>" bound to it, so every group gets
// every message and the members of a group share the work. Messages are
// persistent. The publisher declares a topic's exchange (and the queues of
// Config.DeclareGroups) before its first publish to it on each connection.
//
// # Publishing guarantees
//
//   - Confirms (default; Config.NoConfirm turns them off): Publish returns
//     nil only when the broker acked every message, so a publish that
//     returned nil survived a broker restart. A nack (ErrNacked), or the
//     channel or connection closing before the ack, is an error; after a
//     loss the message may or may not be stored, so retry and let
//     consumers deduplicate (package idempotency).
//   - Unroutable is a failure (default; Config.AllowUnroutable turns it
//     off): every message is published mandatory, and one the broker
//     returns because no queue is bound to the topic's exchange fails
//     the publish with ErrUnroutable, naming the exchange, instead of
//     being silently dropped. The outbox relay then keeps the row pending
//     and the DLQ middleware nacks the original, until a queue exists.
//     It needs confirms (the return is known to be a publish's own only
//     because its confirm follows), so NoConfirm requires
//     AllowUnroutable.
//   - Reconnect: the publisher has its own connection. When it drops, a
//     background loop redials at once, then with backoff (100ms doubling
//     to 5s, each attempt bounded by Config.ConnectTimeout), until Close.
//     Meanwhile Publish fails at once with ErrNotConnected: it does not
//     queue, wait for the connection, or retry (the caller, such as the
//     outbox relay or Watermill's retry middleware, does). The channel
//     pool (Config.ChannelPoolSize) keeps its size through outages: a
//     failed channel is closed and reopened on next use.
//   - Bounded waits: a publish waits at most ConnectTimeout for a free
//     channel, and gives up waiting for a confirm when msg.Context() is
//     done (the message may still be stored). A dead peer is noticed by
//     the 10s heartbeat. During a RabbitMQ resource alarm the broker stops
//     reading from publishers, and a publish waits until the alarm clears
//     or msg.Context() is done.
//   - Batches: the publisher is a transport.BatchPublisher. PublishBatch
//     (what the outbox relay calls, one per topic of a claimed batch)
//     sends with deferred confirms over one pooled channel, or, from 256
//     messages, over up to one free channel per 128 (never more than
//     ChannelPoolSize-1). All messages of one metadata.OrderingKey go on
//     one channel, in order, one at a time: each is sent once the broker
//     confirmed the one before it, while the other keys' messages (and
//     all messages without a key) are in flight beside it. A batch thus
//     costs as many confirm round trips as its longest key has messages,
//     not one per message. It returns a *transport.BatchError naming
//     exactly the messages nacked, returned as unroutable, unconfirmed
//     when a channel or the connection was lost (ErrNotConnected) or
//     their context ended, or not sent (ErrNotSent); the rest were
//     confirmed.
//   - Order under partial failure: in PublishBatch and in a Publish of
//     several messages alike, a key stops at its first failure, and the
//     rest of it is reported not sent (ErrNotSent), so the broker never
//     holds a message of a key after one it refused (a nack from a full
//     queue with x-overflow=reject-publish, a return, a loss). When the
//     outbox relay (or whoever repeats a failed Publish) publishes them
//     again, a consumer that drops duplicates applies each aggregate in
//     order. Publish sends the messages of one call as PublishBatch does
//     on one channel: each key's one at a time, the keys together.
//   - Close is idempotent and never panics: it refuses new publishes
//     (ErrClosed), waits up to ConnectTimeout for those in flight, then
//     closes the connection, failing any still waiting.
//
// Where it falls short: a fanout exchange keeps nothing for a queue that
// does not exist yet, so a group's queue must exist before events for it
// are published: a publish while no queue at all is bound fails
// (ErrUnroutable), but one while only some groups' queues exist reaches
// only those. Subscribe once at deployment, or list the groups in
// Config.DeclareGroups so the publisher declares their queues
// itself. With watermill-amqp's subscriber, ordering holds per queue only
// while one consumer with prefetch 1 reads it; a nacked message is
// requeued and can overtake later ones (KeyParallelism keeps each key in
// order at any prefetch).
// Concurrent Publish calls use different channels, so only the messages
// of one call keep their order among themselves. Subscribers open their
// connection on the first Transport.Subscriber call and reconnect by
// themselves (watermill-amqp); a KeyedSubscriber has a connection per
// subscribed queue.
//
// # Consuming: keys in parallel
//
// watermill-amqp's subscriber hands out a queue's next delivery only after
// the previous one's ack, so one subscriber runs one handler at a time, and
// a nack requeues the message behind its key's later ones. With
// Config.KeyParallelism above 0 (MILLWRIGHT_AMQP_KEY_PARALLELISM) every
// subscriber is a KeyedSubscriber instead, on the same queues, headers and
// Marshaler, and the Router and its middlewares do not change:
//
//   - messages of one metadata.OrderingKey run strictly in queue order, one
//     at a time; different keys run concurrently, up to KeyParallelism;
//   - a delivery is acked only after its handler finished (acks are per
//     delivery tag): a crash or a lost connection redelivers exactly the
//     unacked deliveries, and since a key's are all at or after its first
//     unfinished one, RabbitMQ gives them back in the key's order (a
//     deduplicating consumer, package idempotency, applies each key in
//     order);
//   - at most Config.Prefetch deliveries (the channel's QoS; default 16 ×
//     KeyParallelism, at least 100) are unacked: memory is bounded;
//   - a nacked message runs again after 100 ms in its key's place, never
//     requeued; a message that keeps failing holds its key until the retry
//     budget ends (package park parks it instead);
//   - a lost connection or channel is redialled at once, then with backoff
//     (100 ms to 5 s); a handler still running from the lost channel keeps
//     its key until it returns, and its ack is lost (redelivered); the
//     lost channel's deliveries waiting behind it are dropped at once
//     (RabbitMQ sends them again), so they do not hold Prefetch slots
//     the other keys need;
//   - the queue is consumed exclusively: a key keeps its order across a
//     half-open connection (the client's side lost, RabbitMQ's still open,
//     as when a NAT or conntrack entry is dropped), because no new
//     consumer gets the queue's deliveries while the old connection's are
//     unacked. RabbitMQ closes such a connection at its heartbeat timeout
//     (10 s heartbeat; about 30 s measured) and requeues its deliveries;
//     until then consuming is refused ("in exclusive use") and retried:
//     the queue waits at most that timeout plus 5 s (about 35 s);
//   - Close waits up to Config.KeyDrainTimeout (default 30s) for the
//     messages out, acks those acked, then closes the channel: RabbitMQ
//     requeues the rest.
//
// Per-key order needs one consumer on the queue (RabbitMQ spreads a
// queue's deliveries over its consumers), which the exclusive consume
// enforces: a second process of the group waits as a standby and takes
// over when the first one's connection ends. No queue argument changes
// (x-single-active-consumer would be one, and RabbitMQ refuses to
// redeclare an existing queue with other arguments: PRECONDITION_FAILED),
// so existing queues need no migration; but a queue consumed by
// watermill-amqp's subscriber (KeyParallelism 0) in another process makes
// this one wait until that consumer stops.
//
// `millwright-bench consume --kind amqp` measures it against
// watermill-amqp's subscriber in the same run (idempotency middleware, a
// pg_sleep in its transaction, KeyParallelism 16): on 2026-12-03, at
// --scale 0.2 on a 2-core machine loaded by other work, 7.5x the msgs/s
// with a trivial handler, 13.8x at 5 ms and 15.2x at 50 ms, no reorders.
//
// CloudEvents (AMQP protocol binding, binary mode): the metadata.Event*
// attributes travel as application properties (headers) "cloudEvents:<attr>"
// and datacontenttype as the content-type property; consumers get the same
// metadata keys back.
package amqp
