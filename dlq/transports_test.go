// Runs dlqtest.TestPoisonDoesNotBlock, and a dead letter whose recorder
// starts late, on every transport kind through the transport package, on
// the real brokers transporttest finds.
package dlq_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/transporttest"
)

func TestPoisonDoesNotBlockAllTransports(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		name := string(kind)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			topic := fmt.Sprintf("poison_%s_%d", name, time.Now().UnixNano()%1e6)
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, []string{topic, dlq.DefaultTopic(topic)}, "dlqtest")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			tr, err := transport.Open(ctx, transporttest.Config(t, kind))
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })
			sub, err := tr.Subscriber("dlqtest")
			require.NoError(t, err)
			dlqtest.TestPoisonDoesNotBlock(t, tr.Publisher(), sub, topic)
			t.Logf("%s: %s", name, time.Since(start))
		})
	}
}

// countingPublisher counts the publishes to one topic that failed and that
// succeeded, keeping the last error, and signals each.
type countingPublisher struct {
	message.Publisher
	topic string

	mu        sync.Mutex
	failed    int
	succeeded int
	lastErr   error
	changed   chan struct{} // closed and replaced at each publish to topic
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	if topic != p.topic {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.failed++
		p.lastErr = err
	} else {
		p.succeeded++
	}
	close(p.changed)
	p.changed = make(chan struct{})
	return err
}

// waitFor waits, until ctx ends, for cond to hold on the counts.
func (p *countingPublisher) waitFor(ctx context.Context, cond func(failed, succeeded int) bool) (failed, succeeded int, lastErr error, ok bool) {
	for {
		p.mu.Lock()
		failed, succeeded, lastErr, changed := p.failed, p.succeeded, p.lastErr, p.changed
		p.mu.Unlock()
		if cond(failed, succeeded) {
			return failed, succeeded, lastErr, true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return failed, succeeded, lastErr, false
		}
	}
}

// A poison message on a fresh topic whose dead-letter topic has no
// recorder yet is not lost (issue item: dead letters vanished on
// RabbitMQ). On amqp and googlecloud nothing would receive the dead
// letter, so its publish fails (ErrUnroutable, ErrNoSubscription), the
// original is nacked and redelivered, and dead-lettered again each time,
// until the recorder subscribes; then the dead letter arrives. On kafka
// and sql the dead-letter topic keeps it for a group that starts later
// (kafka: InitialOffset oldest; sql: a new group reads from the start),
// so it is published at once. On gochannel it is kept in memory by the
// persistent mode (the default) and replayed to the late subscriber; with
// NotPersistent, or across a restart, it would be gone: gochannel is for
// tests and one process only.
func TestDeadLetterWaitsForItsRecorderAllTransports(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		name := string(kind)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testDeadLetterWaitsForItsRecorder(t, kind)
		})
	}
}

func testDeadLetterWaitsForItsRecorder(t *testing.T, kind transport.Kind) {
	name := string(kind)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	topic := fmt.Sprintf("latedl_%s_%s", name, watermill.NewShortUUID())
	dlTopic := dlq.DefaultTopic(topic)
	if kind == transport.AMQP {
		transporttest.DeleteAMQPTopology(t, []string{topic, dlTopic}, "svc", "recorder")
	}
	tr, err := transport.Open(ctx, transporttest.Config(t, kind))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })

	// The service: its own topic exists and is subscribed before
	// the poison message is published; its dead-letter topic has
	// no subscriber at all.
	sub, err := tr.Subscriber("svc")
	require.NoError(t, err)
	if si, ok := sub.(message.SubscribeInitializer); ok {
		require.NoError(t, si.SubscribeInitialize(topic))
	}
	pub := &countingPublisher{Publisher: tr.Publisher(), topic: dlTopic, changed: make(chan struct{})}
	mw, err := dlq.NewMiddleware(pub, dlq.Config{ConsumerGroup: "svc", Retry: retry.Policy{MaxAttempts: 1}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var attempts atomic.Int64
	router.AddConsumerHandler("svc-"+topic, topic, sub, func(msg *message.Message) error {
		attempts.Add(1)
		return fmt.Errorf("poison message %s always fails", msg.UUID)
	}).AddMiddleware(mw.Middleware)
	dlqtest.RunRouter(ctx, t, router)
	poison := message.NewMessage(watermill.NewUUID(), []byte("poison"))
	require.NoError(t, tr.Publisher().Publish(topic, poison))

	requireDeadLetterKept(ctx, t, kind, pub, &attempts)

	// The recorder starts afterwards.
	rec, err := tr.Subscriber("recorder")
	require.NoError(t, err)
	if si, ok := rec.(message.SubscribeInitializer); ok {
		require.NoError(t, si.SubscribeInitialize(dlTopic))
	}
	dead, err := rec.Subscribe(ctx, dlTopic)
	require.NoError(t, err)
	awaitLateDeadLetter(ctx, t, dead, poison, topic, pub, &attempts)
}

// requireDeadLetterKept waits until the dead letter is either kept by its
// topic for a later group (published) or refused while nothing could
// receive it, with the original redelivered (AMQP, Pub/Sub).
func requireDeadLetterKept(ctx context.Context, t *testing.T, kind transport.Kind, pub *countingPublisher, attempts *atomic.Int64) {
	switch kind {
	case transport.AMQP, transport.GoogleCloud:
		// Dead-lettered, refused, nacked, redelivered and
		// dead-lettered again: the original was not acked away.
		failed, succeeded, lastErr, ok := pub.waitFor(ctx, func(f, s int) bool { return f >= 2 || s > 0 })
		require.Zero(t, succeeded, "a dead letter was published while nothing could receive it: the broker dropped it")
		require.True(t, ok, "the dead-letter publish did not fail twice (failed %d)", failed)
		if kind == transport.AMQP {
			require.ErrorIs(t, lastErr, amqp.ErrUnroutable)
		} else {
			require.ErrorIs(t, lastErr, googlecloud.ErrNoSubscription)
		}
		require.GreaterOrEqual(t, attempts.Load(), int64(2), "the original was not redelivered")
	default:
		// Kept by the topic for a later group: published at once.
		_, _, _, ok := pub.waitFor(ctx, func(_, s int) bool { return s >= 1 })
		require.True(t, ok, "the dead letter was not published")
	}
}

// awaitLateDeadLetter waits for poison's dead letter on dead, the late
// recorder's subscription.
func awaitLateDeadLetter(ctx context.Context, t *testing.T, dead <-chan *message.Message, poison *message.Message, topic string, pub *countingPublisher, attempts *atomic.Int64) {
	for {
		select {
		case dl := <-dead:
			dl.Ack()
			if dl.Metadata.Get(metadata.DeadLetterOriginalMessageID) != poison.UUID {
				continue
			}
			require.Equal(t, topic, dl.Metadata.Get(metadata.DeadLetterOriginalTopic))
			require.Equal(t, "svc", dl.Metadata.Get(metadata.DeadLetterConsumerGroup))
			require.Equal(t, "poison", string(dl.Payload))
			pub.mu.Lock()
			t.Logf("%s: dead letter arrived after %d failed dead-letter publishes and %d attempts", t.Name(), pub.failed, attempts.Load())
			pub.mu.Unlock()
			return
		case <-ctx.Done():
			pub.mu.Lock()
			defer pub.mu.Unlock()
			t.Fatalf("the dead letter did not reach the late recorder (dead-letter publishes: %d failed, %d succeeded; last error %v)", pub.failed, pub.succeeded, pub.lastErr)
		}
	}
}
