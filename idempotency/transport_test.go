package idempotency_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/transport"
	tramqp "github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// Through every transport kind: the relay publishes some events twice, the
// Duplicator runs every delivery twice, and the consumer "dies" after the
// commit of one event but before its ack (the delivery is nacked, so the
// broker redelivers it). Each event's effect is applied once.
func TestEveryTransportAppliesOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts in-process Kafka and Pub/Sub and uses RabbitMQ; skipped with -short")
	}
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			testTransportAppliesOnce(t, kind)
		})
	}
}

func testTransportAppliesOnce(t *testing.T, kind transport.Kind) {
	b := setupPG(t)
	tr, topic := openAppliesOnceTransport(t, kind, b)
	sub, err := tr.Subscriber(appliesOnceGroup(topic))
	require.NoError(t, err)
	if init, ok := sub.(message.SubscribeInitializer); ok {
		// Kafka: a consumer group that joins before its topic exists
		// waits for a metadata refresh.
		require.NoError(t, init.SubscribeInitialize(topic))
	}

	m, reg := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)

	const unique, republished = 6, 3
	handled := make(chan string, 4*(unique+republished))
	var crashes atomic.Int32
	router.AddMiddleware(crashOnceOnEvt0(handled, &crashes), middleware.Duplicator, m.Middleware)
	router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
		_, err := effectHandler("billing")(msg)
		return err
	})
	runAppliesOnceRouter(t, router)

	pub := tr.Publisher()
	for i := range unique {
		require.NoError(t, pub.Publish(topic, idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
	}
	for i := range republished {
		require.NoError(t, pub.Publish(topic, idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
	}

	timeout := time.After(60 * time.Second)
	for range unique + republished {
		select {
		case <-handled:
		case <-timeout:
			t.Fatalf("timed out: %d effects", countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
		}
	}
	require.Equal(t, unique, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
	require.Equal(t, unique, countRows(t, b.schema.DB, `SELECT count(DISTINCT event_id) FROM effects`))
	require.EqualValues(t, unique, metric(t, reg, idempotency.MetricProcessed, "billing"))
	require.EqualValues(t, 1, crashes.Load(), "the consumer died before the ack of evt-0")
	// Every delivery runs the middleware twice (Duplicator) and all but
	// the first of each event are duplicates: the 9 handled deliveries
	// plus the crashed one make at least 2*10-6 = 14 duplicates; 12
	// if the crash or its redelivery had not happened.
	require.GreaterOrEqual(t, metric(t, reg, idempotency.MetricDuplicates, "billing"),
		float64(2*(unique+republished+1)-unique), "duplicates: the crashed delivery of evt-0 was redelivered")
}

// openAppliesOnceTransport opens kind's transport, the broker named by
// MILLWRIGHT_TEST_* when set, else an embedded one; SQL in the test's own
// schema. It returns a fresh topic; the test's cleanup closes the
// transport and removes RabbitMQ's topology. Register it before the
// router's, so the router stops first.
func openAppliesOnceTransport(t *testing.T, kind transport.Kind, b *pgBundle) (*transport.Transport, string) {
	cfg := transport.Config{Kind: transport.SQL}
	cfg.SQL.DB = b.schema.DB
	if kind != transport.SQL {
		cfg = transporttest.Config(t, kind)
	}
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	var r [4]byte
	_, _ = rand.Read(r[:])
	topic := "idem_orders_" + hex.EncodeToString(r[:])
	t.Cleanup(func() {
		_ = tr.Close()
		if kind == transport.AMQP {
			if err := tramqp.DeleteTopology(cfg.AMQP.URL, []string{topic}, appliesOnceGroup(topic)); err != nil {
				t.Logf("cleanup: %v", err)
			}
		}
	})
	return tr, topic
}

// appliesOnceGroup is the consumer group of topic: the same random suffix.
func appliesOnceGroup(topic string) string {
	return "idem_billing_" + strings.TrimPrefix(topic, "idem_orders_")
}

// crashOnceOnEvt0 passes each handled delivery's event id to handled,
// except the first successful one of evt-0: its effect committed, the
// consumer "dies" before the ack, and the broker redelivers it.
func crashOnceOnEvt0(handled chan<- string, crashes *atomic.Int32) message.HandlerMiddleware {
	var crashOnce sync.Once
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				return nil, err
			}
			crashed := false
			if msg.Metadata.Get("ce_id") == "evt-0" {
				crashOnce.Do(func() { crashed = true })
			}
			if crashed {
				// Effect committed, ack lost: the broker redelivers.
				crashes.Add(1)
				return nil, testError("consumer died before ack")
			}
			handled <- msg.Metadata.Get("ce_id")
			return out, nil
		}
	}
}

// runAppliesOnceRouter runs router until the test ends.
func runAppliesOnceRouter(t *testing.T, router *message.Router) {
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-runErr
	})
	select {
	case <-router.Running():
	case err := <-runErr:
		t.Fatalf("router stopped: %v", err)
	}
}
