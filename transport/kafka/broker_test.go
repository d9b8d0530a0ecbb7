package kafka_test

// Tests against a broker, reached through package transport: the real one
// named by MILLWRIGHT_TEST_KAFKA_BROKERS, or kfake (see transporttest).

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/kafka"
	"github.com/millwright/millwright/transport/transporttest"
)

// placementPartitions is the partition count of the topics the placement
// test creates; testdata/murmur2_java.tsv has a column for it.
const placementPartitions = 8

// Every message published with an ordering key lands on the partition the
// reference client computes for that key: with the default partitioner,
// the Java client's (its own output for the keys of testdata, franz-go's
// independent implementation for the others); with "fnv1a", Sarama's hash
// partitioner. The records are read back with franz-go, not through
// millwright.
func TestPublishedKeysLandWhereTheReferenceClientPutsThem(t *testing.T) {
	t.Parallel()

	var keys []string
	java := map[string]int32{}
	for _, v := range kafka.ReadJavaVectors(t) {
		if len(v.Key) == 0 {
			continue // an empty ordering key means no key
		}
		keys = append(keys, string(v.Key))
		java[string(v.Key)] = v.Partition[placementPartitions]
	}
	for i := 0; i < 200; i++ {
		keys = append(keys, fmt.Sprintf("order-%d", i), fmt.Sprintf("Kunde-Ä%d-注文", i*7919))
	}

	franz := kgo.StickyKeyPartitioner(nil).ForTopic("t")
	murmur2 := map[string]int32{}
	for _, k := range keys {
		if p, ok := java[k]; ok {
			murmur2[k] = p
			continue
		}
		murmur2[k] = int32(franz.Partition(&kgo.Record{Key: []byte(k)}, placementPartitions))
	}
	saramaHash := sarama.NewHashPartitioner("t")
	fnv1a := map[string]int32{}
	differ := 0
	for _, k := range keys {
		p, err := saramaHash.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(k)}, placementPartitions)
		require.NoError(t, err)
		fnv1a[k] = p
		if p != murmur2[k] {
			differ++
		}
	}
	require.Greater(t, differ, len(keys)/2, "the keys should tell the two partitioners apart")

	cases := []struct {
		name, partitioner string
		want              map[string]int32
	}{
		{"default is murmur2", "", murmur2},
		{"fnv1a", kafka.PartitionerFNV1a, fnv1a},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := transporttest.Config(t, transport.Kafka)
			cfg.Kafka.Partitioner = tc.partitioner
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()

			topic := "placement_" + watermill.NewShortUUID()
			createTopic(t, cfg.Kafka.Brokers, topic, placementPartitions)
			tr, err := transport.Open(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })

			msgs := make([]*message.Message, len(keys))
			for i, k := range keys {
				msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(k))
				msgs[i].Metadata.Set(metadata.OrderingKey, k)
			}
			require.NoError(t, tr.Publisher().Publish(topic, msgs...))

			records := readAll(ctx, t, cfg.Kafka.Brokers, topic, len(keys))
			var wrong []string
			used := map[int32]bool{}
			for _, r := range records {
				k := string(r.Key)
				require.Equal(t, string(r.Value), k, "the Kafka key should be the ordering key")
				want, ok := tc.want[k]
				require.True(t, ok, "unexpected key %q", k)
				if r.Partition != want {
					wrong = append(wrong, fmt.Sprintf("%q: partition %d, want %d", k, r.Partition, want))
				}
				used[r.Partition] = true
			}
			require.Empty(t, wrong, "%d of %d keys landed elsewhere", len(wrong), len(records))
			require.Len(t, used, placementPartitions, "the keys should reach every partition")
		})
	}
}

// The default protocol version produces and consumes in a consumer group
// (join, sync, offset fetch and commit, fetch) on whichever broker the tests
// use (DefaultVersion on a real broker, KfakeVersion on kfake), and so does
// KfakeVersion against a real broker.
func TestProtocolVersionsProduceAndConsumeInAGroup(t *testing.T) {
	t.Parallel()

	versions := []string{""}
	if transporttest.Real(transport.Kafka) {
		versions = append(versions, kafka.KfakeVersion)
	}
	for _, v := range versions {
		name := v
		if v == "" {
			name = "default"
		}
		t.Run(name, func(t *testing.T) {
			cfg := transporttest.Config(t, transport.Kafka)
			if v != "" {
				cfg.Kafka.Version = v
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			topic := "version_" + watermill.NewShortUUID()
			// After the transport closes, or its consumer could bring the
			// topic back through auto-creation.
			group := "group_" + topic
			t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic, group) })
			tr, err := transport.Open(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })

			sub, err := tr.Subscriber(group)
			require.NoError(t, err)
			// Creates the topic through the admin API, at this version.
			require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)

			sent := map[string]bool{}
			for i := 0; i < 10; i++ {
				m := message.NewMessage(watermill.NewUUID(), []byte("x"))
				m.Metadata.Set(metadata.OrderingKey, fmt.Sprint("key-", i%3))
				sent[m.UUID] = true
				require.NoError(t, tr.Publisher().Publish(topic, m))
			}
			for len(sent) > 0 {
				select {
				case m := <-ch:
					require.True(t, sent[m.UUID], "unexpected or repeated message %s", m.UUID)
					delete(sent, m.UUID)
					m.Ack()
				case <-ctx.Done():
					t.Fatalf("%d of 10 messages not received: %v", len(sent), ctx.Err())
				}
			}
		})
	}
}

// adminConfig is what the tests' own Sarama admin client speaks.
func adminConfig(t *testing.T) *sarama.Config {
	t.Helper()
	sc := sarama.NewConfig()
	v, err := sarama.ParseKafkaVersion(kafka.KfakeVersion) // speaks to both
	require.NoError(t, err)
	sc.Version = v
	sc.Admin.Timeout = 30 * time.Second
	return sc
}

// createTopic creates a topic with the given partitions, deleted at cleanup
// (after whatever the test opens later has closed).
func createTopic(t *testing.T, brokers []string, topic string, partitions int32) {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(brokers, adminConfig(t))
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
	t.Cleanup(func() { deleteTopic(t, brokers, topic) })
}

// deleteTopic deletes a topic and consumer groups the test made, leaving a
// shared broker as it was; failure is only logged.
func deleteTopic(t *testing.T, brokers []string, topic string, groups ...string) {
	admin, err := sarama.NewClusterAdmin(brokers, adminConfig(t))
	if err != nil {
		t.Logf("deleting topic %s: %v", topic, err)
		return
	}
	defer admin.Close()
	if err := admin.DeleteTopic(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		t.Logf("deleting topic %s: %v", topic, err)
	}
	for _, g := range groups {
		if err := admin.DeleteConsumerGroup(g); err != nil {
			t.Logf("deleting consumer group %s: %v", g, err)
		}
	}
}

// readAll reads n records of topic from the start of every partition with
// franz-go (no consumer group), failing when ctx ends first.
func readAll(ctx context.Context, t *testing.T, brokers []string, topic string, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	)
	require.NoError(t, err)
	defer cl.Close()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read %d of %d records of %s: %v", len(out), n, topic, err)
		}
		fs.EachError(func(topic string, p int32, err error) {
			t.Logf("fetching %s/%d: %v", topic, p, err) // franz-go retries
		})
		out = append(out, fs.Records()...)
	}
	require.Len(t, out, n, "more records than published")
	return out
}
