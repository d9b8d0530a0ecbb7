package transport_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// The kinds whose publisher has PublishBatch deliver every message of a
// batch, each ordering key in order.
func TestPublishBatchKeepsEveryKeyInOrder(t *testing.T) {
	t.Parallel()
	for _, kind := range []transport.Kind{transport.Kafka, transport.AMQP, transport.SQL} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			tr := transporttest.Open(t, kind)
			bp, ok := tr.Publisher().(transport.BatchPublisher)
			require.True(t, ok, "%s publisher has no PublishBatch", kind)
			topic := "batch_order_" + watermill.NewShortUUID()
			sub, err := tr.Subscriber("batch")
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)

			const keys, perKey = 10, 20
			var msgs []*message.Message
			for i := range keys * perKey {
				m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i/keys)))
				m.Metadata.Set(metadata.OrderingKey, fmt.Sprint("k", i%keys))
				msgs = append(msgs, m)
			}
			require.NoError(t, bp.PublishBatch(topic, msgs...))
			next := map[string]int{}
			for range keys * perKey {
				select {
				case m := <-ch:
					k := m.Metadata.Get(metadata.OrderingKey)
					require.Equal(t, fmt.Sprint(next[k]), string(m.Payload), "key %s out of order", k)
					next[k]++
					m.Ack()
				case <-ctx.Done():
					t.Fatalf("received %v of %d per key", next, perKey)
				}
			}
		})
	}
}
