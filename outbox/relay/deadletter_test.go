package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// An event the relay gives up on reaches its dead-letter topic with
// package dlq's envelope: dlq.Store records it like a consumer's poison
// message, with the original topic, and a replay without a target sends it
// back there.
func TestRelay_DeadLetterIsReadByTheDLQTools(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dead := b.collect(t, "orders.dead")
	ctx := context.Background()
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, m *message.Message) error {
		if topic == "orders" {
			return errors.New("message too large")
		}
		return nil
	}}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "o-1", EventType: "order.placed",
		Source: "/orders", Payload: []byte(`{"id":"o-1"}`)}))
	startRelay(t, b.db, pub, Config{PollInterval: 5 * time.Millisecond, DeadLetterTopic: "orders.dead",
		Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxAttempts: 2}})
	eventually(t, 30*time.Second, func() bool { return len(dead.all()) == 1 }, "the event reaches the dead-letter topic")
	msg := dead.all()[0]
	require.Equal(t, "orders", msg.Metadata.Get(metadata.DeadLetterOriginalTopic))
	require.Equal(t, "order.placed", msg.Metadata.Get(metadata.EventType), "the event's own metadata is kept")

	// The envelope package dlq's recorder reads (this package cannot
	// import dlq, whose replay queues through it: dlq's tests record it).
	require.Equal(t, "orders.dead", msg.Metadata.Get(metadata.DeadLetterTopic))
	require.Equal(t, DeadLetterHandler, msg.Metadata.Get(metadata.DeadLetterHandler))
	require.Equal(t, "exhausted", msg.Metadata.Get(metadata.DeadLetterReason)) // dlq.ReasonExhausted
	require.Equal(t, "2", msg.Metadata.Get(metadata.DeadLetterAttempts))
	require.Contains(t, msg.Metadata.Get(metadata.DeadLetterError), "message too large")
}

// A permanent publish error is dead-lettered at once, with reason
// permanent.
func TestDeadLetterMessage_Permanent(t *testing.T) {
	t.Parallel()
	rw := row{topic: "t", msg: message.NewMessage("u-1", []byte(`{}`))}
	rw.msg.Metadata.Set(metadata.DeadLetterReason, "stale")
	m := deadLetterMessage(rw, "t.dead", failure.Permanent(errors.New("schema rejected")), 1, time.Unix(0, 0), time.Unix(0, 0))
	require.Equal(t, dlq.ReasonPermanent, m.Metadata.Get(metadata.DeadLetterReason), "stale dlq_ keys of the event are replaced")
	require.Equal(t, "1", m.Metadata.Get(metadata.DeadLetterAttempts))
	require.Equal(t, "u-1", m.UUID)
}
