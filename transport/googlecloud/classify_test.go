package googlecloud_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// A message over Pub/Sub's 10 MB publish request is refused by the client
// with an error that is permanent and names ErrMessageTooLarge, so the
// outbox relay fails the row at once instead of retrying it; a message
// just under the limit is published.
func TestTooLargeIsPermanent(t *testing.T) {
	t.Parallel()
	cfg := transporttest.Config(t, transport.GoogleCloud)
	cfg.GoogleCloud.AllowUnreceived = true
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic := "size_" + watermill.NewShortUUID()
	pub := tr.Publisher()

	err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), transport.GoogleCloudMaxMessageBytes)))
	require.ErrorIs(t, err, transport.ErrMessageTooLarge, "%v", err)
	require.True(t, failure.IsPermanent(err), "%v", err)

	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), 1000))))
}

// The relay publishes many rows per call: PublishBatch answers for each
// message, so one refused for good fails alone (permanent), its key's
// later messages are held back (not permanent: they go out after it), and
// the other keys are published. Before, the one error of Publish was every
// row's, and the relay failed all of them for good.
func TestPublishBatchFailsOnlyTheRefusedMessage(t *testing.T) {
	t.Parallel()
	cfg := transporttest.Config(t, transport.GoogleCloud)
	cfg.GoogleCloud.AllowUnreceived = true
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	bp, ok := tr.Publisher().(transport.BatchPublisher)
	require.True(t, ok, "the googlecloud publisher has no PublishBatch")
	msg := func(key string, size int) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), size))
		m.Metadata.Set(metadata.OrderingKey, key)
		return m
	}
	msgs := []*message.Message{msg("a", 10), msg("b", transport.GoogleCloudMaxMessageBytes), msg("b", 10), msg("c", 10)}
	err = bp.PublishBatch("batch_"+watermill.NewShortUUID(), msgs...)
	var be *transport.BatchError
	require.ErrorAs(t, err, &be, "%v", err)
	require.Len(t, be.Failed, 2, "%v", err)
	require.ErrorIs(t, be.Failed[1], transport.ErrMessageTooLarge)
	require.True(t, failure.IsPermanent(be.Failed[1]))
	require.Error(t, be.Failed[2])
	require.False(t, failure.IsPermanent(be.Failed[2]), "the key's next message is held back, not refused: %v", be.Failed[2])
	require.Contains(t, be.Failed[2].Error(), "not sent")
}
