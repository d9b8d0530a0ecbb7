// Runs a parked key through a real Router on every transport kind, on the
// real brokers transporttest finds (else the embedded ones).
package park_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
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

func TestParkedKeyEveryTransport(t *testing.T) {
	if testing.Short() {
		t.Skip("uses the brokers; skipped with -short")
	}
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			testParkedKeyTransport(t, kind)
		})
	}
}

func testParkedKeyTransport(t *testing.T, kind transport.Kind) {
	var r [4]byte
	_, _ = rand.Read(r[:])
	suffix := hex.EncodeToString(r[:])
	topic, group := "park_orders_"+suffix, "park_billing_"+suffix
	if kind == transport.AMQP {
		transporttest.DeleteAMQPTopology(t, []string{topic}, group)
	}
	tr := transporttest.Open(t, kind)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	if init, ok := sub.(message.SubscribeInitializer); ok {
		require.NoError(t, init.SubscribeInitialize(topic))
	}

	b := setup(t, pgtest.DriverPQ)
	a := newApp()
	p := b.parker(t, park.Config{PollInterval: 20 * time.Millisecond, Retry: patient})
	rm, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: time.Millisecond, MaxAttempts: 2}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("billing", topic, sub, func(m *message.Message) error {
		_, err := a.handle(m)
		return err
	}).AddMiddleware(p.Middleware("billing-"+suffix), rm.Middleware)

	ctx, cancel := context.WithCancel(context.Background())
	routerDone, parkerDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		_ = router.Close()
		require.NoError(t, <-routerDone)
		require.NoError(t, p.Close())
		require.NoError(t, <-parkerDone)
	})
	select {
	case <-router.Running():
	case <-time.After(60 * time.Second):
		t.Fatal("router did not start")
	}
	go func() { parkerDone <- p.Run(ctx) }() // after the router applied the middleware

	pub := tr.Publisher()
	send := func(uuid, key string) {
		m := msg(uuid, key)
		require.NoError(t, pub.Publish(topic, m))
	}
	a.fail("a1")
	send("a1", "a")
	poll.Until(t, 90*time.Second, func() bool { return len(b.keys(t)) == 1 }, "%s: key a parked", kind)
	// gochannel does not keep publish order (each publish is handed over
	// on a goroutine of its own), so each message of key a is sent once
	// the previous one is parked: the order tested is park's.
	for i, u := range []string{"a2", "a3"} {
		send(u, "a")
		poll.Until(t, 60*time.Second, func() bool {
			ks := b.keys(t)
			return len(ks) == 1 && ks[0].Messages == int64(i+2)
		}, "%s: %s parked behind", kind, u)
	}
	for i := range 5 {
		send(fmt.Sprintf("b%d", i), "b")
	}
	// Key b completes while key a stays parked with its later messages.
	poll.Until(t, 60*time.Second, func() bool {
		ks := b.keys(t)
		return len(a.order(isKey("b"))) == 5 && len(ks) == 1 && ks[0].Messages == 3
	}, "%s: key b done while key a parked: applied %v, parked %v", kind, a.appliedList(), b.keys(t))
	require.Empty(t, a.order(isKey("a")))

	a.heal("a1")
	poll.Until(t, 60*time.Second, func() bool { return len(a.order(isKey("a"))) == 3 }, "%s: key a applied after healing: %v", kind, b.keys(t))
	require.Equal(t, []string{"a1", "a2", "a3"}, a.order(isKey("a")))
	poll.Until(t, 30*time.Second, func() bool { return len(b.keys(t)) == 0 }, "%s: key a released", kind)
}
