package kafka

import (
	"sync"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/internal/keyed"
)

// topicPartition names a partition.
type topicPartition struct {
	topic     string
	partition int32
}

// keyedStats is one held partition's keys in flight and messages waiting.
type keyedStats struct {
	keys, waiting int
}

// keyedLive is the partitions a KeyedSubscriber holds now, for LagReader.
type keyedLive struct {
	mu    sync.Mutex
	parts map[topicPartition]*keyed.Partition[*sarama.ConsumerMessage]
}

func (l *keyedLive) track(topic string, part int32, p *keyed.Partition[*sarama.ConsumerMessage]) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.parts == nil {
		l.parts = map[topicPartition]*keyed.Partition[*sarama.ConsumerMessage]{}
	}
	l.parts[topicPartition{topic, part}] = p
}

func (l *keyedLive) untrack(topic string, part int32, p *keyed.Partition[*sarama.ConsumerMessage]) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.parts[topicPartition{topic, part}] == p {
		delete(l.parts, topicPartition{topic, part})
	}
}

// stats returns the keys in flight and messages waiting in each partition
// s holds now.
func (s *KeyedSubscriber) stats() map[topicPartition]keyedStats {
	s.live.mu.Lock()
	parts := make(map[topicPartition]*keyed.Partition[*sarama.ConsumerMessage], len(s.live.parts))
	for k, p := range s.live.parts {
		parts[k] = p
	}
	s.live.mu.Unlock()
	out := make(map[topicPartition]keyedStats, len(parts))
	for k, p := range parts {
		keys, waiting := p.Stats()
		out[k] = keyedStats{keys: keys, waiting: waiting}
	}
	return out
}
