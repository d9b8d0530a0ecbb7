package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/kafka"
	"github.com/millwright/millwright/transport/lag"
	"github.com/millwright/millwright/transport/transporttest"
)

// A key-parallel consumer holding key a's first message and key b's, with
// a's two later messages queued behind, shows 2 keys in flight and 2
// messages waiting on its partition; nothing is committed yet, so the
// group is 4 behind (counted from the partition's oldest offset).
func TestLagOfAKeyParallelConsumer(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := transporttest.Config(t, transport.Kafka).Kafka
	cfg.KeyParallelism = 4
	cfg.Partitions = 1
	tr, err := kafka.Open(ctx, cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic, group := "lag-keyed-"+watermill.NewShortUUID(), "lag-keyed-"+watermill.NewShortUUID()
	s, err := tr.Subscriber(group)
	require.NoError(t, err)
	sub, ok := s.(*kafka.KeyedSubscriber)
	require.True(t, ok, "KeyParallelism > 0 gives the key-parallel subscriber, got %T", s)
	require.NoError(t, sub.SubscribeInitialize(topic))
	for _, k := range []string{"a", "a", "b", "a"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(k))
		msg.Metadata.Set(metadata.OrderingKey, k)
		require.NoError(t, tr.Publisher().Publish(topic, msg))
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var held []*message.Message
	for range 2 {
		select {
		case m := <-ch:
			held = append(held, m)
		case <-ctx.Done():
			t.Fatal("the keys' first messages were not delivered")
		}
	}
	require.ElementsMatch(t, []string{"a", "b"}, []string{string(held[0].Payload), string(held[1].Payload)})

	r, err := kafka.NewLagReader(cfg, kafka.LagConfig{Groups: []string{group}, Topics: []string{topic}, Keyed: []*kafka.KeyedSubscriber{sub}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	var row lag.Partition
	poll.Until(t, time.Minute, func() bool {
		ps, err := r.Lag(ctx)
		require.NoError(t, err)
		require.Len(t, ps, 1)
		row = ps[0]
		return row.Waiting == 2
	}, "a's two later messages queued behind it")
	require.Equal(t, lag.Partition{Transport: "kafka", Group: group, Topic: topic, Partition: 0, Committed: -1, End: 4, Lag: 4, Unacked: -1,
		Keyed: true, KeysInFlight: 2, Waiting: 2}, row)
	for _, m := range held {
		m.Ack()
	}
}
