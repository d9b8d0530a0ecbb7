package kafka

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// replicationErrors publishes one message to topic through a transport
// on brokers and returns the error lines its logger got.
func replicationErrors(t *testing.T, brokers []string, topic string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	logger := watermill.NewCaptureLogger()
	tr, err := Open(ctx, Config{Brokers: brokers}, logger)
	require.NoError(t, err)
	defer func() { _ = tr.Close() }()
	require.NoError(t, tr.Publisher().Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))))
	var lines []string
	for _, m := range logger.Captured()[watermill.ErrorLogLevel] {
		lines = append(lines, m.Msg)
	}
	return lines
}

func createClusterTopic(t *testing.T, brokers []string, topic string, rf int16, configs map[string]*string) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	ca, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	defer func() { _ = ca.Close() }()
	require.NoError(t, ca.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 2, ReplicationFactor: rf, ConfigEntries: configs}, false))
	t.Cleanup(func() {
		ca, err := sarama.NewClusterAdmin(brokers, sc)
		if err == nil {
			_ = ca.DeleteTopic(topic)
			_ = ca.Close()
		}
	})
}

// On the three-broker cluster, the first publish to a topic of
// replication factor 1 logs an error naming the topic and the fix; one to
// a topic of three replicas with min.insync.replicas=1 names that, one
// with unclean leader election on names that; a topic as the doc asks
// (RF 3, min.insync.replicas=2) logs nothing.
func TestPublishingToAnUnreplicatedTopicOnAClusterWarns(t *testing.T) {
	brokers := clusterBrokers(t)
	one := "rf1_" + watermill.NewShortUUID()
	createClusterTopic(t, brokers, one, 1, nil)
	lines := replicationErrors(t, brokers, one)
	require.Len(t, lines, 1, "want one replication warning for %s: %q", one, lines)
	require.Contains(t, lines[0], "topic "+one+" has replication factor 1 on a cluster of 3 brokers")
	require.Contains(t, lines[0], "--replication-factor 3 --config min.insync.replicas=2")
	t.Log(lines[0])

	isr1 := "isr1_" + watermill.NewShortUUID()
	v := "1"
	createClusterTopic(t, brokers, isr1, 3, map[string]*string{"min.insync.replicas": &v})
	lines = replicationErrors(t, brokers, isr1)
	require.Len(t, lines, 1, "want one min.insync.replicas warning for %s: %q", isr1, lines)
	require.Contains(t, lines[0], "topic "+isr1+" has min.insync.replicas=1 with replication factor 3")

	unclean := "unclean_" + watermill.NewShortUUID()
	yes := "true"
	createClusterTopic(t, brokers, unclean, 3, map[string]*string{"unclean.leader.election.enable": &yes})
	lines = replicationErrors(t, brokers, unclean)
	require.Len(t, lines, 1, "want one unclean election warning for %s: %q", unclean, lines)
	require.Contains(t, lines[0], "topic "+unclean+" has unclean.leader.election.enable=true")

	good := "rf3_" + watermill.NewShortUUID()
	createClusterTopic(t, brokers, good, 3, nil) // the cluster's default min.insync.replicas=2
	require.Empty(t, replicationErrors(t, brokers, good), "a topic with RF 3 and min.insync.replicas=2 must not warn")
}

// On the single broker, a topic of replication factor 1 is all there can
// be: no warning.
func TestPublishingOnASingleBrokerDoesNotWarn(t *testing.T) {
	v := os.Getenv("MILLWRIGHT_TEST_KAFKA_BROKERS")
	if v == "" {
		t.Skip("needs the single Kafka broker: MILLWRIGHT_TEST_KAFKA_BROKERS")
	}
	topic := "rf1_single_" + watermill.NewShortUUID()
	lines := replicationErrors(t, strings.Split(v, ","), topic) // auto-created, RF 1
	require.Empty(t, lines, "a single broker must not warn about replication")
}
