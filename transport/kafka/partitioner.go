package kafka

import (
	"fmt"

	"github.com/IBM/sarama"
)

// Partitioners accepted in Config.Partitioner.
const (
	// PartitionerMurmur2 places a keyed message as the Apache Kafka Java
	// client and franz-go do: toPositive(murmur2(key)) % partitions.
	PartitionerMurmur2 = "murmur2"
	// PartitionerFNV1a is Sarama's hash partitioner (FNV-1a), which
	// millwright used before murmur2.
	PartitionerFNV1a = "fnv1a"
)

// partitioner returns the Sarama partitioner named by p (already validated).
func partitioner(p string) (sarama.PartitionerConstructor, error) {
	switch p {
	case PartitionerMurmur2:
		return newMurmur2Partitioner, nil
	case PartitionerFNV1a:
		return sarama.NewHashPartitioner, nil
	}
	return nil, fmt.Errorf("kafka: Partitioner %q: want %s or %s", p, PartitionerMurmur2, PartitionerFNV1a)
}

// murmur2Partitioner is the Java client's partitioner for keyed records
// (BuiltInPartitioner.partitionForKey). Keyless messages go where Sarama's
// hash partitioner sends them: to a random partition.
type murmur2Partitioner struct {
	random sarama.Partitioner
}

func newMurmur2Partitioner(topic string) sarama.Partitioner {
	return &murmur2Partitioner{random: sarama.NewRandomPartitioner(topic)}
}

// Partition implements sarama.Partitioner.
func (p *murmur2Partitioner) Partition(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	if msg.Key == nil {
		return p.random.Partition(msg, numPartitions)
	}
	key, err := msg.Key.Encode()
	if err != nil {
		return -1, err
	}
	return partitionForKey(key, numPartitions), nil
}

// RequiresConsistency implements sarama.Partitioner: a key's partition is
// used even while that partition has no leader (Sarama retries), or the
// key's order would be lost.
func (p *murmur2Partitioner) RequiresConsistency() bool { return true }

// MessageRequiresConsistency implements sarama.DynamicConsistencyPartitioner,
// as Sarama's hash partitioner does: a keyless message may go to any
// partition that is available.
func (p *murmur2Partitioner) MessageRequiresConsistency(msg *sarama.ProducerMessage) bool {
	return msg.Key != nil
}

// partitionForKey is the Java client's formula: the hash with its sign bit
// cleared (Utils.toPositive), modulo the partition count.
func partitionForKey(key []byte, numPartitions int32) int32 {
	return int32(murmur2(key)&0x7fffffff) % numPartitions
}

// murmur2 is MurmurHash2 (32-bit) with Kafka's seed, as
// org.apache.kafka.common.utils.Utils.murmur2 computes it: four bytes at a
// time, little-endian, then the one to three bytes left over.
func murmur2(data []byte) uint32 {
	const (
		seed = 0x9747b28c
		m    = 0x5bd1e995
		r    = 24
	)
	h := uint32(seed) ^ uint32(len(data))
	for len(data) >= 4 {
		k := uint32(data[0]) | uint32(data[1])<<8 | uint32(data[2])<<16 | uint32(data[3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
		data = data[4:]
	}
	switch len(data) {
	case 3:
		h ^= uint32(data[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(data[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(data[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
