// Package nats is millwright's NATS JetStream transport. Applications
// reach it through package transport (MILLWRIGHT_TRANSPORT=nats://host:4222).
//
// # What is Watermill's and what is millwright's
//
// The publisher and the subscribers are millwright's own, on nats.go's
// jetstream package; from watermill-nats (v2.1.3) millwright takes the
// wire format's UUID header (UUIDHeader, watermill-nats's
// "_watermill_message_uuid"), so either side's messages are read by the
// other. watermill-nats's JetStream package (pkg/jetstream, "beta") has
// no seam for what this transport promises: its publisher sends no
// Nats-Msg-Id and publishes with context.Background (no bound, no
// deduplication); its subscriber naks a failed message to the server
// (which redelivers it behind its key's later ones), gives up waiting for
// a handler after AckWaitTimeout without acking or nacking it (the server
// then redelivers it beside the running one), sends no in-progress
// acknowledgement, dereferences a nil message when unmarshaling fails, and
// drains the connection it was given on Close. Its older pkg/nats (the
// JetStream API of nats.go before the jetstream package) has the same
// gaps.
//
// # Streams and consumers
//
// Each topic is a stream (StreamName: the topic, or with a dot in it, the
// topic with underscores and a hash suffix) whose one subject is the topic;
// the publisher creates it on its first publish to the topic, and
// Subscribe or SubscribeInitialize create it too (an existing stream keeps
// its settings). Its settings: file storage; Config.Replicas replicas
// (default 1); limits retention, so a message stays after every group
// acknowledged it, for Config.MaxAge (default 7 days; a new consumer group
// starts at the oldest message); discard old; a duplicate window of
// Config.DuplicateWindow (default 2 minutes).
//
// Each consumer group is a durable pull consumer on the stream (named
// after the group, "default" for group ""), created or updated by
// Subscribe: explicit acks; deliver all (a new group starts at the oldest
// message); AckWait Config.AckWait (default 30s); MaxAckPending
// Config.MaxAckPending (default 1,000, or 16 × KeyParallelism); MaxDeliver
// Config.MaxDeliver (default -1, unlimited); the pinned-client priority
// policy, priority group "millwright", PinnedTTL (below).
//
// # Publishing guarantees
//
//   - Publish returns nil once the stream stored (acknowledged) every
//     message; each carries its UUID (the outbox event id) as
//     Nats-Msg-Id, so a message published again within the duplicate
//     window (the relay after a lost acknowledgement) is acknowledged and
//     dropped by the server. A replayed dead letter keeps its event id, so
//     its Nats-Msg-Id adds the dead letter's id (MsgID): the replay is
//     not dropped as a duplicate of the original.
//   - A key's messages go one at a time, the keys together (see
//     Publisher): a key stops at its first failure, so the stream never
//     holds a message of a key after one that failed (the relay's
//     first-delivery order per aggregate).
//   - Errors no retry can fix are marked failure.Permanent: a message over
//     the server's max_payload (transport.ErrMessageTooLarge; outbox.Add
//     checks the same limit, Config.MaxPayload, 1 MiB by default, when the
//     writer has the transport's Limits), a subject the server refuses
//     (transport.ErrInvalidName), credentials refused at Open, a server
//     without JetStream. A stream deleted under the publisher is created
//     again by the next publish.
//   - While the connection is down, publishes wait for it (nats.go buffers
//     them), bounded by the message's context and Config.ConnectTimeout;
//     the connection is redialled forever.
//
// # Consuming
//
// See Subscriber: messages of one metadata.OrderingKey in stream order,
// one at a time; with Config.KeyParallelism
// (MILLWRIGHT_NATS_KEY_PARALLELISM) different keys at once; acks only
// after the handler finished; nacks rerun in the key's place; in-progress
// acknowledgements while a message is held, so a handler that outlives
// AckWait is not overtaken by its own redelivery; MaxDeliver's end goes
// to Config.DeadLetterTopic, never a silent drop. A consumer that dies
// holding messages has them redelivered AckWait after its last
// in-progress acknowledgement.
//
// One member of a group consumes at a time (the pinned client of
// JetStream's pinned-client priority policy; the others are standbys),
// which keeps a key in order across the group's members; a member that
// dies hands the pin on PinnedTTL (AckWait + AckWait/3 + 5 s, 45 s by
// default) after its last pull, once its held messages are back, and
// those redeliveries (which JetStream sends out of stream order: seen 20,
// 7, 9..16, 6, 17..19) are collected and sorted by stream sequence before
// they run. A member that ends its subscription gives its messages back
// (naks confirmed by the server, in stream order) and hands the pin on at
// once. Where it falls short: a group's throughput is one member's (use
// KeyParallelism); a standby takes over a dead member's group only after
// PinnedTTL (RedeliveryBound); priority groups need nats-server 2.11 or
// later.
//
// `millwright-bench consume --kind nats` measures the key-parallel
// consumer against the same subscriber one message at a time, in the same
// run (idempotency middleware, a pg_sleep in its transaction,
// KeyParallelism 16, 10,000 keys): on 2026-12-06, at --scale 0.5 on a
// 2-core machine loaded by other work, 16.2x the msgs/s at a 50 ms handler
// (277 against 17) and 7.2x with a trivial one, 0 reorders (an earlier
// run: 15.9x and 2.9x).
//
// CloudEvents (NATS protocol binding, binary mode): the metadata.Event*
// attributes travel as "ce-<attr>" headers and datacontenttype as
// "content-type" (cloudevent.NATS); traceparent and other metadata as
// headers of their own name.
//
// Health and metrics: Config.Registerer receives the Metric* gauges
// (stream messages, each group's pending messages, its lag, and its
// unacknowledged ones), refreshed every 10 s.
package nats
