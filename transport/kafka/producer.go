package kafka

import (
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
)

// Producer settings (see the package doc, "Producer settings", for the
// reasons; the Java client's defaults since Kafka 3.0 in Sarama's terms,
// but for idempotence).
const (
	// producerRetries is Producer.Retry.Max: with producerBackoff, Sarama
	// retries a partition whose leader died for about 7.5 s, long enough
	// for a controller to fence a dead broker (broker.session.timeout.ms,
	// 9 s by default, less the time already spent) on most failovers, and
	// well inside the outbox relay's publish bound (0.4 x its 30 s
	// lease), so that a longer outage reaches the relay as an error it
	// retries, instead of a call that outlives its lease.
	producerRetries = 10
	// producerBackoffMin and producerBackoffMax bound Sarama's backoff
	// between retries: doubling from 100 ms, as the Java client's
	// retry.backoff.ms and retry.backoff.max.ms (100 ms, 1 s).
	producerBackoffMin = 100 * time.Millisecond
	producerBackoffMax = time.Second
)

// producerBackoff is Producer.Retry.BackoffFunc: 100 ms, 200 ms, 400 ms,
// 800 ms, then 1 s.
func producerBackoff(retries, _ int) time.Duration {
	d := producerBackoffMin
	for i := 1; i < retries && d < producerBackoffMax; i++ {
		d *= 2
	}
	return min(d, producerBackoffMax)
}

// tuneProducer sets the producer's delivery settings on sc: nothing lost
// and each key's order kept when a partition's leader changes.
func tuneProducer(sc *sarama.Config) {
	// acks=all: a write is acknowledged once every in-sync replica has it
	// (at least min.insync.replicas of them), so the replica that becomes
	// leader when this one dies has it too.
	sc.Producer.RequiredAcks = sarama.WaitForAll
	// enable.idempotence stays off: Sarama 1.43.3's idempotent producer
	// (the version watermill-kafka v3.0.6 pins) mis-sequences retried
	// batches (IBM/sarama#2619, #2803, #2860; fixed by #3422 in a later
	// release). With it on, Watermill's suite on the single broker got
	// "The broker received an out of order sequence number" on every
	// retry of a partition, and 10 of the 5,000 messages it had sent never
	// arrived (TestContinueAfterSubscribeClose). Order does not rest on it:
	// PublishBatch never has two messages of one key in flight (rounds),
	// and Publish waits for each message. A retry's duplicate, which
	// idempotence would drop at the broker, is dropped by the
	// idempotency middleware at the consumer.
	sc.Producer.Idempotent = false
	// max.in.flight.requests.per.connection=1: a retried batch cannot
	// overtake a later one on the connection.
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = producerRetries
	sc.Producer.Retry.BackoffFunc = producerBackoff
}

// replicationAdvice is what checkReplication found wrong with a topic's
// durability, or "" when nothing.
func replicationAdvice(topic string, brokers int, rf int, minISR int, unclean bool) string {
	switch {
	case brokers > 1 && rf == 1:
		return fmt.Sprintf("kafka: topic %s has replication factor 1 on a cluster of %d brokers: when the broker holding a partition dies, its events are unavailable, and lost if its disk is; recreate the topic with replication factor 3 and min.insync.replicas=2 (kafka-topics.sh --create --replication-factor 3 --config min.insync.replicas=2), or raise it with kafka-reassign-partitions.sh", topic, brokers)
	case rf >= 3 && minISR >= 0 && minISR < 2:
		return fmt.Sprintf("kafka: topic %s has min.insync.replicas=%d with replication factor %d: acks=all then waits for the leader alone, and a failover can lose what it acknowledged; set min.insync.replicas=2 (kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config min.insync.replicas=2)", topic, minISR, rf, topic)
	case rf > 1 && unclean:
		return fmt.Sprintf("kafka: topic %s has unclean.leader.election.enable=true: a replica that is not in sync can become leader and drop acknowledged events; set it to false (kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config unclean.leader.election.enable=false)", topic, topic)
	}
	return ""
}

// checkReplication warns, once per topic (from awaitTopic), when topic
// is not replicated as the delivery guarantees need: replication factor
// 1 on a cluster of several brokers, min.insync.replicas below 2 with 3
// replicas or more, or unclean leader election on. It only logs: a
// single-broker development cluster is fine as it is, and the topic's
// owner decides. Failing to read the topic's configuration is logged at
// debug level and skips those two checks.
func (p *Publisher) checkReplication(topic string) {
	parts, err := p.client.Partitions(topic)
	if err != nil || len(parts) == 0 {
		return
	}
	rf := 0
	for _, part := range parts {
		replicas, err := p.client.Replicas(topic, part)
		if err != nil {
			return
		}
		if rf == 0 || len(replicas) < rf {
			rf = len(replicas)
		}
	}
	brokers := len(p.client.Brokers())
	minISR, unclean := -1, false
	if rf > 1 {
		minISR, unclean = p.topicConfig(topic)
	}
	if advice := replicationAdvice(topic, brokers, rf, minISR, unclean); advice != "" {
		p.logger.Error(advice, nil, watermill.LogFields{"topic": topic, "replication_factor": rf, "brokers": brokers})
	}
}

// topicConfig reads topic's min.insync.replicas (-1 when unknown) and
// unclean.leader.election.enable from any broker.
func (p *Publisher) topicConfig(topic string) (minISR int, unclean bool) {
	minISR = -1
	b := p.client.LeastLoadedBroker()
	if b == nil {
		return minISR, false
	}
	resp, err := b.DescribeConfigs(&sarama.DescribeConfigsRequest{
		Version: 1,
		Resources: []*sarama.ConfigResource{{
			Type: sarama.TopicResource, Name: topic,
			ConfigNames: []string{"min.insync.replicas", "unclean.leader.election.enable"},
		}},
	})
	if err != nil {
		p.logger.Debug("kafka: reading topic configuration for the replication check", watermill.LogFields{"topic": topic, "err": err.Error()})
		return minISR, false
	}
	for _, r := range resp.Resources {
		if r.ErrorCode != 0 {
			p.logger.Debug("kafka: reading topic configuration for the replication check", watermill.LogFields{"topic": topic, "err": r.ErrorMsg})
			continue
		}
		for _, c := range r.Configs {
			switch c.Name {
			case "min.insync.replicas":
				if n, err := strconv.Atoi(c.Value); err == nil {
					minISR = n
				}
			case "unclean.leader.election.enable":
				unclean = c.Value == "true"
			}
		}
	}
	return minISR, unclean
}
