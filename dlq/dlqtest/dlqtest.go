package dlqtest

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// Timeout bounds how long TestPoisonDoesNotBlock waits for the messages; it
// is generous because some emulated brokers deliver slowly on a busy machine.
var Timeout = 90 * time.Second

// PoisonAttempts is the retry MaxAttempts TestPoisonDoesNotBlock uses.
const PoisonAttempts = 3

// TestPoisonDoesNotBlock checks that a message that always fails does not
// stop the messages published after it on the same topic (with the same
// ordering key), and that it reaches the dead-letter topic after exactly
// PoisonAttempts attempts with its metadata.
//
// pub and sub must reach the same broker; sub subscribes to topic and to
// dlq.DefaultTopic(topic). topic should be unique to the test. The helper
// initializes both topics when sub is a message.SubscribeInitializer,
// subscribes before it publishes and waits for the router to run.
func TestPoisonDoesNotBlock(t *testing.T, pub message.Publisher, sub message.Subscriber, topic string) {
	t.Helper()
	const good = 10
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()

	dlTopic := dlq.DefaultTopic(topic)
	// Create the topics first where the transport needs it (Kafka): a
	// consumer that subscribed to a missing topic may not see it appear.
	if si, ok := sub.(message.SubscribeInitializer); ok {
		for _, tp := range []string{topic, dlTopic} {
			require.NoError(t, si.SubscribeInitialize(tp), "initializing topic %s", tp)
		}
	}
	dead, err := sub.Subscribe(ctx, dlTopic)
	require.NoError(t, err, "subscribing to the dead-letter topic %s", dlTopic)

	mw, err := dlq.NewMiddleware(pub, dlq.Config{
		ConsumerGroup: "dlqtest",
		Retry:         retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxAttempts: PoisonAttempts},
	})
	require.NoError(t, err)

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	h := &poisonHandler{good: good, processed: map[string]bool{}, processedDone: make(chan struct{})}
	router.AddConsumerHandler("dlqtest-"+topic, topic, sub, h.handle).AddMiddleware(mw.Middleware)

	RunRouter(ctx, t, router)

	poison, msgs := poisonAndGood(good)
	for _, m := range msgs {
		require.NoError(t, pub.Publish(topic, m), "publishing to %s", topic)
	}

	select {
	case <-h.processedDone:
	case <-ctx.Done():
		h.mu.Lock()
		n := len(h.processed)
		h.mu.Unlock()
		t.Fatalf("only %d of %d messages behind the poison message were processed within %s", n, good, Timeout)
	}

	select {
	case dl := <-dead:
		dl.Ack()
		requireDeadLetterOf(t, dl, poison, topic)
	case <-ctx.Done():
		t.Fatalf("poison message did not reach dead-letter topic %s within %s", dlTopic, Timeout)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	require.Equal(t, PoisonAttempts, h.poisonTries, "attempts on the poison message")
}

// poisonHandler fails every poison message and records the good ones,
// closing processedDone when good distinct ones were handled.
type poisonHandler struct {
	good          int
	mu            sync.Mutex
	poisonTries   int
	processed     map[string]bool
	processedDone chan struct{}
}

func (h *poisonHandler) handle(msg *message.Message) error {
	if string(msg.Payload) == "poison" {
		h.mu.Lock()
		h.poisonTries++
		h.mu.Unlock()
		return fmt.Errorf("poison message %s always fails", msg.UUID)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.processed[msg.UUID] {
		h.processed[msg.UUID] = true
		if len(h.processed) == h.good {
			close(h.processedDone)
		}
	}
	return nil
}

// poisonAndGood is a poison message followed by good ones, all on one
// ordering key.
func poisonAndGood(good int) (poison *message.Message, msgs []*message.Message) {
	msgs = make([]*message.Message, 0, good+1)
	poison = message.NewMessage(watermill.NewUUID(), []byte("poison"))
	poison.Metadata.Set(metadata.OrderingKey, "dlqtest")
	poison.Metadata.Set(metadata.TraceParent, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	msgs = append(msgs, poison)
	for i := range good {
		m := message.NewMessage(watermill.NewUUID(), []byte("good "+strconv.Itoa(i)))
		m.Metadata.Set(metadata.OrderingKey, "dlqtest")
		msgs = append(msgs, m)
	}
	return poison, msgs
}

// requireDeadLetterOf checks that dl is poison's dead letter from topic.
func requireDeadLetterOf(t *testing.T, dl, poison *message.Message, topic string) {
	t.Helper()
	require.Equal(t, poison.UUID, dl.Metadata.Get(metadata.DeadLetterOriginalMessageID))
	require.Equal(t, topic, dl.Metadata.Get(metadata.DeadLetterOriginalTopic))
	require.Equal(t, dlq.ReasonExhausted, dl.Metadata.Get(metadata.DeadLetterReason))
	require.Equal(t, strconv.Itoa(PoisonAttempts), dl.Metadata.Get(metadata.DeadLetterAttempts))
	require.Contains(t, dl.Metadata.Get(metadata.DeadLetterError), "always fails")
	require.Equal(t, poison.Metadata.Get(metadata.TraceParent), dl.Metadata.Get(metadata.TraceParent))
	require.Equal(t, "poison", string(dl.Payload))
}

// RunRouter runs router until the test ends (closing it and waiting for
// Run to return at cleanup) and returns once it is running, failing the
// test if it is not running before ctx ends.
func RunRouter(ctx context.Context, t testing.TB, router *message.Router) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		_ = router.Close()
		<-done
	})
	select {
	case <-router.Running():
	case <-ctx.Done():
		t.Fatalf("dlqtest: router did not start: %v", ctx.Err())
	}
}
