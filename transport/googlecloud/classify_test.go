package googlecloud_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/retry"
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
	require.True(t, retry.IsPermanent(err), "%v", err)

	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), bytes.Repeat([]byte("x"), 1000))))
}
