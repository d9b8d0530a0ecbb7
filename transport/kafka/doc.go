// Package kafka is millwright's Kafka transport, built on watermill-kafka
// (Sarama). Applications reach it through package transport; import it
// directly only to tune Sarama.
//
// Guarantees: consumer groups are Kafka group ids; messages with the same
// metadata.OrderingKey become the same Kafka message key and land on one
// partition, in publish order (the producer keeps one request in flight per
// broker so retries cannot reorder them). The partition is the one the Java
// client and franz-go choose for that key (murmur2), so producers written
// with any of them keep a key's messages together; Config.Partitioner
// "fnv1a" keeps Sarama's hash partitioner for topics it already filled.
// Publishes wait for all in-sync replicas. A nacked message is redelivered to
// the same consumer after NackResendSleep; offsets are committed after ack.
//
// Consumers: by default watermill-kafka's subscriber, which hands out a
// partition's messages one at a time. Config.KeyParallelism above 0
// (MILLWRIGHT_KAFKA_KEY_PARALLELISM) makes consumer-group subscribers
// KeyedSubscribers: keys in parallel within a partition, one key in order,
// offsets committed only up to the oldest unfinished message (see
// KeyedSubscriber for the guarantees, rebalances and bounds).
//
// CloudEvents (Kafka protocol binding, binary mode): the metadata.Event*
// attributes travel as "ce_<attr>" headers and datacontenttype as the
// "content-type" header; consumers get the same metadata keys back.
//
// # Producer settings
//
// The producer is set for no loss and per-key order when a partition's
// leader dies mid-batch. They are the Java client's defaults since Kafka
// 3.0 (KIP-679) in Sarama's terms, but for idempotence; Config.Tune can
// change them:
//
//   - Producer.RequiredAcks = WaitForAll (Java acks=all): the leader
//     answers once every in-sync replica has the batch, at least
//     min.insync.replicas of them; the replica elected when the leader
//     dies is one of those, so an acknowledged event survives the
//     failover. acks=1 would lose what the dead leader had not yet
//     replicated.
//   - Net.MaxOpenRequests = 1 (Java max.in.flight.requests.per.connection,
//     at most 5): one request in flight per broker, so a retried batch
//     cannot overtake a later one on the connection.
//   - Producer.Retry.Max = 10, backoff doubling from 100 ms to 1 s (Java
//     retries=MAX_INT bounded by delivery.timeout.ms=2m; retry.backoff.ms
//     100 ms, retry.backoff.max.ms 1 s): Sarama rides out about 7.5 s of a
//     partition without a leader (a controller fences a dead broker after
//     broker.session.timeout.ms, 9 s by default). Longer outages reach
//     the caller as errors: the outbox relay leaves the rows pending and
//     retries them with its own backoff, well inside its publish bound
//     (0.4 x relay.Config.Lease), which Sarama's calls ignore.
//   - Producer.Idempotent = false (Java enable.idempotence=true): Sarama
//     1.43.3, the version watermill-kafka v3.0.6 pins, mis-sequences
//     retried batches of its idempotent producer (IBM/sarama#2619, #2803,
//     #2860; fixed by #3422 in a later Sarama). Turned on here, Watermill's
//     suite on one broker got "The broker received an out of order
//     sequence number" on each retry of a partition, and 10 of the 5,000
//     messages it had sent never arrived. Without it, a batch that the
//     dying leader wrote but did not acknowledge is written again by
//     Sarama's retry or the relay's: consumers see that copy twice, and
//     the idempotency middleware drops the second (at least once, as
//     every millwright transport). Order does not depend on it (below).
//     Sarama accepts Idempotent only with Version 0.11 or later,
//     RequiredAcks WaitForAll, Net.MaxOpenRequests 1 and Retry.Max 1 or
//     more (its config validation), all of which hold here: once Sarama
//     is upgraded past the fix, Config.Tune can turn it on; do not on
//     1.43.3.
//
// PublishBatch sends a batch in rounds (one message per ordering key per
// round) and sends nothing more of a key once one of its messages failed,
// so a failover cannot store a later event of an aggregate ahead of an
// earlier one (see Publisher.PublishBatch).
//
// # What the topics must look like
//
// The producer settings keep their promise only on topics that are
// replicated:
//
//   - replication factor 3 (Config.ReplicationFactor for topics the
//     subscriber creates; default 1, for single-broker development);
//   - min.insync.replicas=2: with acks=all a write is on two brokers before
//     it is acknowledged, and one broker can die without stopping writes;
//   - unclean.leader.election.enable=false (Kafka's default): a replica
//     that is out of sync must never become leader, or it drops events the
//     others acknowledged.
//
// The first time a publisher sends to a topic it reads the topic's
// metadata and configuration and logs an error naming the topic and the
// fix when the topic has replication factor 1 on a cluster of several
// brokers, min.insync.replicas below 2 with 3 replicas or more, or unclean
// leader election on. It only logs: a single-broker cluster is not
// warned about, and the topic's owner decides.
//
// TestLeaderFailoverUnderLoad (CI's failover stage, on the three-broker
// cluster of `scripts/services.sh cluster up`) checks this: 100,000
// outbox events of 1,000 aggregates through three relays, the leader of
// the busiest partition SIGKILLed twice mid-drain, and consumers behind
// the idempotency middleware apply every event once, in aggregate order.
package kafka
