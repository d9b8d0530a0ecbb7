package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	tnats "github.com/millwright/millwright/transport/nats"
	"github.com/millwright/millwright/transport/transporttest"
)

// refusalCounter counts the messages its batch publisher reports failed.
type refusalCounter struct {
	transport.BatchPublisher
	refused atomic.Int64
}

func (c *refusalCounter) PublishBatch(topic string, msgs ...*message.Message) error {
	err := c.BatchPublisher.PublishBatch(topic, msgs...)
	var be *transport.BatchError
	if errors.As(err, &be) {
		for _, e := range be.Failed {
			if !errors.Is(e, tnats.ErrNotSent) {
				c.refused.Add(1)
			}
		}
	} else if err != nil {
		c.refused.Add(int64(len(msgs)))
	}
	return err
}

// JetStream refuses part of a batch: the topic's stream (created here
// first, with max_bytes and discard new) is nearly full, so the first
// event of each aggregate, big, is refused ("maximum bytes exceeded"),
// while its later ones, small, would fit. A consumer that drops
// duplicates must still apply each aggregate in outbox order: nothing of
// an aggregate may be stored ahead of its refused event. The filler that
// takes the room is deleted only after every big event was refused at
// least once (counted); then the relay's retries get through.
func TestRelayKeepsFirstDeliveryOrderWhenJetStreamRefusesPartOfABatch(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := pgtest.New(t, outbox.Migrations())
	cfg := transporttest.Config(t, transport.NATS)
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic := "outbox_refuse_" + watermill.NewShortUUID()
	const group = "outbox-test"

	nc, err := natsgo.Connect(cfg.NATS.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	const limit, room = 20000, 600
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: tnats.StreamName(topic), Subjects: []string{topic}, Storage: jetstream.FileStorage,
		MaxBytes: limit, Discard: jetstream.DiscardNew, Duplicates: time.Minute,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), tnats.StreamName(topic)) })
	filler, err := js.Publish(ctx, topic, make([]byte, limit-room-200))
	require.NoError(t, err)

	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))

	const aggs, perAgg = 4, 4
	for seq := 1; seq <= perAgg; seq++ {
		for a := range aggs {
			ev := seqEvent{Agg: fmt.Sprintf("agg-%02d", a), Seq: seq}
			if seq == 1 {
				ev.Pad = strings.Repeat("x", 1000)
			}
			payload, _ := json.Marshal(ev)
			require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateType: "test", AggregateID: ev.Agg, EventType: "test.seq.v1", Payload: payload}))
		}
	}
	bp, ok := tr.Publisher().(transport.BatchPublisher)
	require.True(t, ok, "the nats publisher has no PublishBatch")
	pub := &refusalCounter{BatchPublisher: bp}
	rel, err := relay.New(postgres.From(s.DB), pub, relay.Config{
		BatchSize: 50, PollInterval: 20 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxAttempts: -1},
	})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- rel.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, rel.Close())
		require.NoError(t, <-relayDone)
	})
	poll.Until(t, time.Minute, func() bool { return pub.refused.Load() >= aggs },
		"JetStream did not refuse the big events: the fault did not happen")
	require.NoError(t, stream.DeleteMsg(ctx, filler.Sequence))

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	applied := newFirstApplied()
	for len(applied.seen) < aggs*perAgg {
		select {
		case m := <-msgs:
			var ev seqEvent
			require.NoError(t, json.Unmarshal(m.Payload, &ev), "payload of %s", m.UUID)
			applied.apply(t, m.Metadata.Get(metadata.EventID), ev, true, "NATS JetStream")
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("received %d of %d events (%d refusals): %v; arrivals: %v", len(applied.seen), aggs*perAgg, pub.refused.Load(), ctx.Err(), applied.trace)
		}
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)))
	t.Logf("%d refusals; arrivals: %v", pub.refused.Load(), applied.trace)
}
