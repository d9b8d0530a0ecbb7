package kafka_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/kafka"
	"github.com/millwright/millwright/transport/transporttest"
)

// A message the broker refuses for its size (a topic created with a small
// max.message.bytes) or Sarama refuses (over Producer.MaxMessageBytes)
// can never be published: the error is permanent and names
// ErrMessageTooLarge, so the outbox relay fails the row at once instead
// of retrying it for its whole budget. Publish and PublishBatch alike.
func TestTooLargeIsPermanent(t *testing.T) {
	t.Parallel()
	cfg := transporttest.Config(t, transport.Kafka)
	if !transporttest.Real(transport.Kafka) {
		t.Skip("needs a real broker (topic max.message.bytes): set MILLWRIGHT_TEST_KAFKA_BROKERS")
	}
	topic := "size_small_" + watermill.NewShortUUID()
	admin, err := sarama.NewClusterAdmin(cfg.Kafka.Brokers, adminConfig(t))
	require.NoError(t, err)
	small := "2000"
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &small}}, false))
	require.NoError(t, admin.Close())
	t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic) })
	tr := transporttest.Open(t, transport.Kafka)
	pub := tr.Publisher()

	// Within the topic's limit: published.
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), 100))))

	// Over the topic's limit, under Sarama's: the broker refuses it.
	err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), 5000)))
	require.Error(t, err)
	require.ErrorIs(t, err, sarama.ErrMessageSizeTooLarge, "the broker's answer: %v", err)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge, "%v", err)
	require.True(t, failure.IsPermanent(err), "a message too large for the topic is permanent: %v", err)
	require.True(t, transport.IsPermanent(err))

	bp := pub.(transport.BatchPublisher)
	ok := message.NewMessage(watermill.NewUUID(), []byte("small"))
	big := message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), 5000))
	err = bp.PublishBatch(topic, ok, big)
	var be *batch.Error
	require.True(t, errors.As(err, &be), "a partial failure: %v", err)
	require.ErrorIs(t, be.Failed[1], transport.ErrMessageTooLarge)
	require.True(t, failure.IsPermanent(be.Failed[1]), "%v", be.Failed[1])
	// The broker refuses a whole record batch: the small message, when
	// Sarama put it in the large one's batch, failed too, but not for
	// good, since alone it fits.
	if e := be.Failed[0]; e != nil {
		require.False(t, failure.IsPermanent(e), "the small message's refusal is not its own: %v", e)
		require.NotErrorIs(t, e, transport.ErrMessageTooLarge)
	}

	// Over Sarama's Producer.MaxMessageBytes (1 MiB): refused before the
	// broker, by Sarama's own count of payload, key and headers.
	err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), transport.KafkaMaxMessageBytes)))
	require.ErrorIs(t, err, transport.ErrMessageTooLarge, "%v", err)
	require.ErrorContains(t, err, "Producer.MaxMessageBytes")
	require.True(t, failure.IsPermanent(err), "%v", err)
}

// A topic outside the allow-list is refused with a permanent error.
func TestInvalidTopicIsPermanent(t *testing.T) {
	t.Parallel()
	tr := transporttest.Open(t, transport.Kafka)
	err := tr.Publisher().Publish("bad topic/ü", message.NewMessage(watermill.NewUUID(), []byte("x")))
	require.ErrorIs(t, err, transport.ErrInvalidName)
	require.True(t, failure.IsPermanent(err), "an invalid name does not become valid by retrying: %v", err)
}

// transport.Limits counts a message as Sarama does (ByteSize of what the
// Marshaler makes: key, value, headers under their CloudEvents names),
// which Sarama compares with Producer.MaxMessageBytes.
func TestLimitsSizeIsSaramasByteSize(t *testing.T) {
	t.Parallel()
	limits := transport.DefaultLimits(transport.Kafka)
	for _, md := range []map[string]string{
		nil,
		{metadata.OrderingKey: "order/o-1", metadata.EventDataContentType: "application/json", metadata.EventID: "e-1"},
		{metadata.EventType: "Kunde-Ä-注文", "x": "", metadata.TraceParent: "00-01020300000000000000000000000000-0405060000000000-01"},
	} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"a":1}`))
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		pm, err := kafka.Marshaler{}.Marshal("orders", msg)
		require.NoError(t, err)
		require.Equal(t, pm.ByteSize(2), limits.Size("orders", msg.UUID, msg.Payload, msg.Metadata), "metadata %v", md)
	}
}

// A batch of many rounds (one busy ordering key: one round trip per
// message) stops between rounds once its context ends: the rounds sent are
// reported sent, the rest not sent with the context's error, instead of
// the call running past its bound (the outbox relay's lanes' lease) with
// nothing reported. Before, SendMessages went on to the last round and the
// call returned nil long after its deadline.
func TestPublishBatchStopsBetweenRoundsAtItsDeadline(t *testing.T) {
	t.Parallel()
	tr := transporttest.Open(t, transport.Kafka)
	bp := tr.Publisher().(transport.BatchPublisher)
	topic := "rounds_" + watermill.NewShortUUID()
	t.Cleanup(func() { deleteTopic(t, transporttest.Config(t, transport.Kafka).Kafka.Brokers, topic) })
	require.NoError(t, bp.PublishBatch(topic, message.NewMessage(watermill.NewUUID(), []byte("first")))) // the topic exists
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	const n = 2000
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
		msgs[i].Metadata.Set(metadata.OrderingKey, "hot")
		msgs[i].SetContext(ctx)
	}
	err := bp.PublishBatch(topic, msgs...)
	var be *batch.Error
	require.ErrorAs(t, err, &be, "%d rounds of one key all sent after a 100ms deadline: %v", n, err)
	first := n
	for i := range n {
		if be.Failed[i] != nil {
			first = min(first, i)
			require.ErrorIs(t, be.Failed[i], context.DeadlineExceeded)
		} else {
			require.Less(t, i, first, "message %d sent after an earlier one of its key was not", i)
		}
	}
	require.Less(t, first, n)
	require.Len(t, be.Failed, n-first, "the unsent are exactly a suffix of the key")
}

// In a batch, a keyed message that fails stops its key's later messages
// (reported not sent, never written after it), and the other keys'
// messages are sent.
func TestPublishBatchStopsAFailedKey(t *testing.T) {
	t.Parallel()
	if !transporttest.Real(transport.Kafka) {
		t.Skip("needs a real broker: set MILLWRIGHT_TEST_KAFKA_BROKERS")
	}
	tr := transporttest.Open(t, transport.Kafka)
	bp := tr.Publisher().(transport.BatchPublisher)
	topic := "batch_key_stop_" + watermill.NewShortUUID()
	t.Cleanup(func() { deleteTopic(t, transporttest.Config(t, transport.Kafka).Kafka.Brokers, topic) })
	require.NoError(t, bp.PublishBatch(topic, message.NewMessage(watermill.NewUUID(), []byte("first")))) // the topic exists

	keyed := func(payload []byte) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), payload)
		m.Metadata.Set(metadata.OrderingKey, "k")
		return m
	}
	// Over Sarama's Producer.MaxMessageBytes: refused before the broker,
	// for this message alone.
	big := keyed(bytes.Repeat([]byte("x"), transport.KafkaMaxMessageBytes))
	after := keyed([]byte("after"))
	other := message.NewMessage(watermill.NewUUID(), []byte("unkeyed"))
	err := bp.PublishBatch(topic, big, after, other)
	var be *batch.Error
	require.True(t, errors.As(err, &be), "a partial failure: %v", err)
	require.ErrorIs(t, be.Failed[0], transport.ErrMessageTooLarge)
	require.ErrorContains(t, be.Failed[1], `not sent: an earlier message with ordering key "k" failed`)
	require.NotContains(t, be.Failed, 2, "the unkeyed message was sent")
	require.Len(t, be.Failed, 2)
}
