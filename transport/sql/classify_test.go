package sql_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// A message the topic's table cannot hold (a UUID longer than its
// 36-character column) fails for good, with ErrMessageTooLarge; in a
// batch, the others of the call fail without it, to be sent again.
func TestMessageTheTableCannotHoldIsPermanent(t *testing.T) {
	t.Parallel()
	tr := transporttest.Open(t, transport.SQL)
	pub := tr.Publisher()
	topic := "size_" + strings.ToLower(watermill.NewShortUUID())
	bad := message.NewMessage(strings.Repeat("7", 40), []byte(`{}`))
	good := message.NewMessage(watermill.NewUUID(), []byte(`{}`))

	err := pub.Publish(topic, bad)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge, "%v", err)
	require.ErrorContains(t, err, "too long")
	require.True(t, failure.IsPermanent(err), "the id does not get shorter by retrying: %v", err)

	err = pub.(transport.BatchPublisher).PublishBatch(topic, good, bad)
	var be *batch.Error
	require.True(t, errors.As(err, &be), "%v", err)
	require.True(t, failure.IsPermanent(be.Failed[1]), "%v", be.Failed[1])
	require.Error(t, be.Failed[0], "all or none: the good message was not sent")
	require.False(t, failure.IsPermanent(be.Failed[0]), "but it may be sent again: %v", be.Failed[0])

	require.NoError(t, pub.Publish(topic, good))
}
