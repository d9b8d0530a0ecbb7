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
// CloudEvents (Kafka protocol binding, binary mode): the metadata.Event*
// attributes travel as "ce_<attr>" headers and datacontenttype as the
// "content-type" header; consumers get the same metadata keys back.
//
// # Producer settings
//
// The producer is set for no loss and per-key order when a partition's
// leader dies mid-batch. They are the Java client's defaults since Kafka
// 3.0 (KIP-679), in Sarama's terms; Config.Tune can change them, and
// Sarama refuses (at Open) an idempotent producer without the other three:
//
//   - Producer.RequiredAcks = WaitForAll (Java acks=all): the leader
//     answers once every in-sync replica has the batch, at least
//     min.insync.replicas of them; the replica elected when the leader
//     dies is one of those, so an acknowledged event survives the
//     failover. acks=1 would lose what the dead leader had not yet
//     replicated.
//   - Producer.Idempotent = true (Java enable.idempotence=true): each batch
//     carries the producer's id and a sequence number per partition, and
//     the leader, the new one too (producer state is replicated with the
//     log), drops a retry of a batch it already wrote. A leader that
//     writes a batch and dies before answering would otherwise get it
//     twice from Sarama's own retry. Needs Version 0.11 or later (always
//     true here) and, on a cluster with ACLs, IDEMPOTENT_WRITE (implied by
//     WRITE on the topic since Kafka 2.8).
//   - Net.MaxOpenRequests = 1 (Java max.in.flight.requests.per.connection,
//     at most 5 with idempotence): Sarama's idempotent producer requires
//     1. One request in flight per broker also means a retried batch
//     cannot overtake a later batch of the same key.
//   - Producer.Retry.Max = 10, backoff doubling from 100 ms to 1 s (Java
//     retries=MAX_INT bounded by delivery.timeout.ms=2m; retry.backoff.ms
//     100 ms, retry.backoff.max.ms 1 s): Sarama rides out about 7.5 s of a
//     partition without a leader (a controller fences a dead broker after
//     broker.session.timeout.ms, 9 s by default), with no duplicate thanks
//     to the sequence numbers. Longer outages reach the caller as errors:
//     the outbox relay leaves the rows pending and retries them with its
//     own backoff, well inside its publish bound (0.4 x RelayConfig.Lease),
//     which Sarama's calls ignore. A row retried by the relay is a new
//     send: a copy that reached the broker before the error is delivered
//     twice, and the idempotency middleware drops the second.
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
