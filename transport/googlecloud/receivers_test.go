package googlecloud_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/transporttest"
)

// openReceivers opens the transport on the emulator transporttest finds
// (or pstest), with cfg's switches.
func openReceivers(t *testing.T, edit func(*googlecloud.Config)) *googlecloud.Transport {
	t.Helper()
	cfg := transporttest.Config(t, transport.GoogleCloud).GoogleCloud
	edit(&cfg)
	tr, err := googlecloud.Open(context.Background(), cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

func newMsg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

// A publish no subscription would receive fails (the topic missing, or
// there without a subscription; the emulator does not tell them apart),
// until a group subscribes: the failure is
// not remembered, and the message published then is received.
func TestPublishWithoutSubscriptionFails(t *testing.T) {
	t.Parallel()
	tr := openReceivers(t, func(*googlecloud.Config) {})
	topic := "mw_unreceived_" + watermill.NewShortUUID()

	err := tr.Publisher().Publish(topic, newMsg("lost"))
	require.ErrorIs(t, err, googlecloud.ErrNoSubscription)
	require.ErrorContains(t, err, "subscribe a group first, list it in Config.DeclareGroups or MILLWRIGHT_DECLARE_GROUPS, or set AllowUnreceived")

	// The topic alone (as another publisher with AllowUnreceived leaves
	// it) is no better.
	loose := openReceivers(t, func(c *googlecloud.Config) { c.AllowUnreceived = true })
	require.NoError(t, loose.Publisher().Publish(topic, newMsg("dropped by Pub/Sub")))
	err = tr.Publisher().Publish(topic, newMsg("lost"))
	require.ErrorIs(t, err, googlecloud.ErrNoSubscription)

	sub, err := tr.Subscriber("late")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	sent := newMsg("kept")
	require.NoError(t, tr.Publisher().Publish(topic, sent))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	select {
	case got := <-msgs:
		got.Ack()
		require.Equal(t, sent.UUID, got.UUID)
	case <-ctx.Done():
		t.Fatal("the message published after the group subscribed was not received")
	}
}

// The groups of DeclareGroups count: their subscriptions are created
// before the check.
func TestPublishWithDeclaredGroupsPasses(t *testing.T) {
	t.Parallel()
	tr := openReceivers(t, func(c *googlecloud.Config) { c.DeclareGroups = []string{"declared"} })
	topic := "mw_declared_" + watermill.NewShortUUID()
	require.NoError(t, tr.Publisher().Publish(topic, newMsg("kept")))
	require.NoError(t, tr.Publisher().Publish(topic, newMsg("kept too")))
}

// A publish whose context is done fails before it is checked or sent.
func TestPublishCheckIsBoundedByTheMessageContext(t *testing.T) {
	t.Parallel()
	tr := openReceivers(t, func(*googlecloud.Config) {})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := newMsg("x")
	msg.SetContext(ctx)
	err := tr.Publisher().Publish("mw_cancelled_"+watermill.NewShortUUID(), msg)
	require.ErrorIs(t, err, context.Canceled)
}
