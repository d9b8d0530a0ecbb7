package idempotency_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
)

// Watermill's Duplicator runs every delivery through the handler twice, and
// the publisher also sends some events twice: the effect count still equals
// the number of unique events.
func TestRouterWithDuplicatorAppliesOnce(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 64}, logger)
	t.Cleanup(func() { pubSub.Close() })

	m, reg := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)

	const unique, republished = 20, 8
	handled := make(chan struct{}, unique+republished)
	// Outermost: reports each delivery the router finished with.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				handled <- struct{}{}
			}
			return out, err
		}
	}, middleware.Duplicator, m.Middleware)
	router.AddConsumerHandler("billing", "orders", pubSub, func(msg *message.Message) error {
		_, err := effectHandler("billing")(msg)
		return err
	})

	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, receive(t, runErr, "the router to stop"))
	})
	select {
	case <-router.Running():
	case err := <-runErr:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("router not running after 10s")
	}

	for i := range unique {
		require.NoError(t, pubSub.Publish("orders", idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
	}
	for i := range republished {
		require.NoError(t, pubSub.Publish("orders", idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
	}
	timeout := time.After(10 * time.Second)
	for i := range unique + republished {
		select {
		case <-handled:
		case <-timeout:
			t.Fatalf("timed out after 10s: %d of %d deliveries handled", i, unique+republished)
		}
	}

	require.Equal(t, unique, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
	require.Equal(t, unique, countRows(t, b.schema.DB, `SELECT count(DISTINCT event_id) FROM effects`))
	require.EqualValues(t, unique, metric(t, reg, idempotency.MetricProcessed, "billing"))
	// Each of the 28 deliveries is duplicated once; the 8 republished are
	// duplicates on their first run too.
	require.EqualValues(t, unique+2*republished, metric(t, reg, idempotency.MetricDuplicates, "billing"))
}
