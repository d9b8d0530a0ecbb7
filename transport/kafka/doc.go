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
package kafka
