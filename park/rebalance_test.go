package park_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// On Kafka, a key parked by the consumer that owned its partition is
// retried by another member of the group, and the key's later messages,
// consumed by that member after the partition moved to it (the first
// member left: a rebalance), are applied after it, in order. The first
// member never runs a retrier.
func TestParkedKeyMovesWithRebalanceKafka(t *testing.T) {
	if testing.Short() {
		t.Skip("uses Kafka; skipped with -short")
	}
	t.Parallel()
	var r [4]byte
	_, _ = rand.Read(r[:])
	suffix := hex.EncodeToString(r[:])
	topic, group, handler := "park_rebalance_"+suffix, "park_rebalance_g_"+suffix, "billing-"+suffix
	tr := transporttest.Open(t, transport.Kafka)
	b := setup(t, pgtest.DriverPQ)
	a := newApp()

	member := func(name string, p *park.Parker) (stop func()) {
		sub, err := tr.Subscriber(group)
		require.NoError(t, err)
		if init, ok := sub.(message.SubscribeInitializer); ok {
			require.NoError(t, init.SubscribeInitialize(topic))
		}
		rm, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: time.Millisecond, MaxAttempts: 2}})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddConsumerHandler(name, topic, sub, func(m *message.Message) error {
			_, err := a.handle(m)
			return err
		}).AddMiddleware(p.Middleware(handler), rm.Middleware)
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		select {
		case <-router.Running():
		case <-time.After(60 * time.Second):
			t.Fatalf("router %s did not start", name)
		}
		stopped := false
		stop = func() {
			if stopped {
				return
			}
			stopped = true
			require.NoError(t, router.Close())
			require.NoError(t, <-done)
			require.NoError(t, sub.Close())
		}
		t.Cleanup(stop)
		return stop
	}

	first := b.parker(t, park.Config{Retry: patient})
	stopFirst := member("first", first)
	a.fail("k1")
	pub := tr.Publisher()
	require.NoError(t, pub.Publish(topic, msg("k1", "k")))
	poll.Until(t, 90*time.Second, func() bool { return len(b.keys(t)) == 1 }, "k parked by the first member")

	second := b.parker(t, park.Config{PollInterval: 20 * time.Millisecond, Retry: patient})
	member("second", second)
	ctx, cancel := context.WithCancel(context.Background())
	retrier := make(chan error, 1)
	go func() { retrier <- second.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-retrier)
	})
	stopFirst() // the partition moves to the second member

	require.NoError(t, pub.Publish(topic, msg("k2", "k")))
	require.NoError(t, pub.Publish(topic, msg("k3", "k")))
	// k2 and k3 reach the second member; k1 still fails, so they park.
	poll.Until(t, 90*time.Second, func() bool {
		ks := b.keys(t)
		return len(ks) == 1 && ks[0].Messages == 3
	}, "k2 and k3 parked behind k1 by the second member: %v", b.keys(t))
	require.Empty(t, a.order(isKey("k")))
	a.heal("k1")
	poll.Until(t, 60*time.Second, func() bool { return len(a.order(isKey("k"))) == 3 }, "k applied after healing")
	require.Equal(t, []string{"k1", "k2", "k3"}, a.order(isKey("k")))
	poll.Until(t, 30*time.Second, func() bool { return len(b.keys(t)) == 0 }, "k released")
	require.Zero(t, first.Stats().Retried, "the first member ran no retrier")
	require.EqualValues(t, 3, second.Stats().Retried)
	require.EqualValues(t, 2, second.Stats().ParkedBehind, "the second member consumed k2 and k3")
}
