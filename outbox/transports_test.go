package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

type seqEvent struct {
	Agg string `json:"agg"`
	Seq int    `json:"seq"`
}

// TestRelayOnEveryTransport writes events of several aggregates, relays
// them through each transport kind and checks, at a consumer in a
// consumer group, that every event arrived and that each aggregate's
// events arrived in commit order (duplicates allowed: at least once).
func TestRelayOnEveryTransport(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			aggs, perAgg := 20, 10
			if kind == transport.GoogleCloud {
				aggs, perAgg = 10, 5 // pstest delivers one message per ordering key at a time
			}
			runRelayTransport(t, transporttest.Config(t, kind), aggs, perAgg, nil)
		})
	}
}

// TestRelayRidesOutKafkaRefusingPublishes makes the in-process Kafka
// (kfake: a real broker has no request control) refuse the relay's produce
// requests for a while: the relay backs off and retries, and every event
// still arrives, in order per aggregate. The test fails if the broker never
// refused anything.
func TestRelayRidesOutKafkaRefusingPublishes(t *testing.T) {
	t.Parallel()
	kc := transporttest.FakeKafka(t)
	// Sarama retries a refused produce up to 10 times itself; 40 refusals
	// were all absorbed there and the relay never saw one. 200 outlast it.
	const refusals = 200
	var refused atomic.Int32
	runRelayTransport(t, kc.Config(), 10, 10, func(topic string) {
		kc.Cluster.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
			pr := req.(*kmsg.ProduceRequest)
			ours := false
			for _, tp := range pr.Topics {
				ours = ours || tp.Topic == topic
			}
			if !ours {
				return nil, nil, false
			}
			if refused.Add(1) > refusals {
				kc.Cluster.DropControl()
				return nil, nil, false // back to normal
			}
			kc.Cluster.KeepControl()
			resp := pr.ResponseKind().(*kmsg.ProduceResponse)
			for _, tp := range pr.Topics {
				rt := kmsg.NewProduceResponseTopic()
				rt.Topic = tp.Topic
				for _, p := range tp.Partitions {
					rp := kmsg.NewProduceResponseTopicPartition()
					rp.Partition = p.Partition
					rp.ErrorCode = kerr.NotLeaderForPartition.Code
					rt.Partitions = append(rt.Partitions, rp)
				}
				resp.Topics = append(resp.Topics, rt)
			}
			return resp, nil, true
		})
	})
	require.Greater(t, refused.Load(), int32(refusals), "the broker refused %d produce requests, want all %d refusals to have happened", refused.Load(), refusals)
}

func runRelayTransport(t *testing.T, cfg transport.Config, aggs, perAgg int, beforeRelay func(topic string)) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := pgtest.New(t, outbox.Migrations())
	kind := cfg.Kind
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err, "opening %s", kind)
	t.Cleanup(func() { _ = tr.Close() })
	topic := "outbox_relay_" + watermill.NewShortUUID()
	const group = "outbox-test"
	if kind == transport.AMQP {
		transporttest.DeleteAMQPTopology(t, []string{topic}, group)
	}
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	if si, ok := sub.(message.SubscribeInitializer); ok {
		require.NoError(t, si.SubscribeInitialize(topic))
	}
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	// Each event in its own transaction; aggregates interleave.
	for seq := 1; seq <= perAgg; seq++ {
		for a := 0; a < aggs; a++ {
			agg := fmt.Sprintf("agg-%02d", a)
			payload, _ := json.Marshal(seqEvent{Agg: agg, Seq: seq})
			tx, err := s.DB.BeginTx(ctx, nil)
			require.NoError(t, err)
			require.NoError(t, outbox.Add(ctx, tx, outbox.Event{Topic: topic, AggregateType: "test", AggregateID: agg, EventType: "test.seq.v1", Payload: payload}))
			require.NoError(t, tx.Commit())
		}
	}
	if beforeRelay != nil {
		beforeRelay(topic)
	}

	relay, err := outbox.NewRelay(s.DB, tr.Publisher(), outbox.RelayConfig{
		BatchSize: 50, PollInterval: 20 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxAttempts: -1},
	})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, relay.Close())
		require.NoError(t, <-relayDone)
	})

	seen := map[string]bool{}
	last := map[string]int{}
	var mu sync.Mutex
	var trace []string
	total := aggs * perAgg
	for len(seen) < total {
		select {
		case m := <-msgs:
			var ev seqEvent
			require.NoError(t, json.Unmarshal(m.Payload, &ev), "payload of %s", m.UUID)
			id := m.Metadata.Get(metadata.EventID)
			require.Equal(t, m.UUID, id, "message UUID is the CloudEvents id")
			mu.Lock()
			trace = append(trace, fmt.Sprintf("%s/%d", ev.Agg, ev.Seq))
			if !seen[id] {
				seen[id] = true
				if kind != transport.GoChannel { // GoChannel delivers each message from its own goroutine
					require.Equal(t, last[ev.Agg]+1, ev.Seq, "aggregate %s out of order on %s; arrivals: %v", ev.Agg, kind, trace)
				}
				last[ev.Agg] = ev.Seq
			}
			mu.Unlock()
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%s: received %d of %d events: %v", kind, len(seen), total, ctx.Err())
		}
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, s.DB))
	var pending int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`).Scan(&pending))
	require.Zero(t, pending)
	if beforeRelay != nil {
		// The fault reached the relay (not only the client's own retries):
		// some rows were put back with a retry.
		var retried int
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) FROM millwright_outbox WHERE retry_count > 0`).Scan(&retried))
		require.Positive(t, retried, "no row was retried: the relay never met the fault")
	}
}
