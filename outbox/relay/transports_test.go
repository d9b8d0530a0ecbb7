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

	"cloud.google.com/go/pubsub/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/pstest"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
	"github.com/millwright/millwright/transport/transporttest"
)

type seqEvent struct {
	Agg string `json:"agg"`
	Seq int    `json:"seq"`
	Pad string `json:"pad,omitempty"` // to size a message
}

// firstApplied is a consumer that drops duplicates: it applies the first
// copy of each event id and drops later ones, as package idempotency does.
// Order is what such a consumer applies, not the order of the last
// copies: a copy that arrives early is applied early, whatever comes
// after it.
type firstApplied struct {
	seen  map[string]bool
	last  map[string]int // aggregate -> last applied seq
	trace []string       // every arrival, for failure messages
}

func newFirstApplied() *firstApplied {
	return &firstApplied{seen: map[string]bool{}, last: map[string]int{}}
}

// apply takes one delivery of event id; it fails the test if it is the
// first copy of an event that is not its aggregate's next (seqs count
// from 1), unless !ordered (a transport that promises no order).
func (f *firstApplied) apply(t *testing.T, id string, ev seqEvent, ordered bool, what string) {
	t.Helper()
	f.trace = append(f.trace, fmt.Sprintf("%s/%d", ev.Agg, ev.Seq))
	if f.seen[id] {
		return
	}
	f.seen[id] = true
	if ordered {
		require.Equal(t, f.last[ev.Agg]+1, ev.Seq, "aggregate %s applied out of order on %s (first copies must come in outbox order); arrivals: %v", ev.Agg, what, f.trace)
	}
	f.last[ev.Agg] = ev.Seq
}

// TestRelayOnEveryTransport writes events of several aggregates, relays
// them through each transport kind and checks, at a consumer in a
// consumer group that drops duplicates, that every event arrived and that
// it applied each aggregate's events in commit order (the first copy of
// each event in order; duplicates allowed: at least once). It runs on each
// driver of the matrix: the events written in users' transactions of that
// driver (*sql.Tx, pgx.Tx) and the relay on its pool (*sql.DB,
// *pgxpool.Pool).
func TestRelayOnEveryTransport(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		for _, kind := range transport.Kinds {
			t.Run(string(kind), func(t *testing.T) {
				t.Parallel()
				aggs, perAgg := 20, 10
				if kind == transport.GoogleCloud {
					aggs, perAgg = 10, 5 // pstest delivers one message per ordering key at a time
				}
				runRelayTransportOn(t, driver, transporttest.Config(t, kind), aggs, perAgg, nil)
			})
		}
	})
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
	runRelayTransportOn(t, pgtest.DriverPQ, cfg, aggs, perAgg, beforeRelay)
}

// runRelayTransportOn is runRelayTransport with the writers' transactions
// and the relay's pool of driver.
func runRelayTransportOn(t *testing.T, driver string, cfg transport.Config, aggs, perAgg int, beforeRelay func(topic string)) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := pgtest.New(t, outbox.Migrations())
	h := s.Handle(t, driver)
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
			require.NoError(t, inTx(ctx, h, func(tx postgres.Tx) error {
				return outbox.Add(ctx, tx, outbox.Event{Topic: topic, AggregateType: "test", AggregateID: agg, EventType: "test.seq.v1", Payload: payload})
			}))
		}
	}
	if beforeRelay != nil {
		beforeRelay(topic)
	}

	rel, err := relayOn(h, tr.Publisher(), relay.Config{
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

	applied := newFirstApplied()
	total := aggs * perAgg
	for len(applied.seen) < total {
		select {
		case m := <-msgs:
			var ev seqEvent
			require.NoError(t, json.Unmarshal(m.Payload, &ev), "payload of %s", m.UUID)
			id := m.Metadata.Get(metadata.EventID)
			require.Equal(t, m.UUID, id, "message UUID is the CloudEvents id")
			// GoChannel delivers each message from its own goroutine: no order.
			applied.apply(t, id, ev, kind != transport.GoChannel, string(kind))
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%s: received %d of %d events: %v", kind, len(applied.seen), total, ctx.Err())
		}
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, s.Handles(t, driver)))
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

// nackCounter counts the messages its batch publisher reports nacked by
// RabbitMQ, so that a test knows the broker refused some.
type nackCounter struct {
	transport.BatchPublisher
	nacks atomic.Int64
}

func (c *nackCounter) PublishBatch(topic string, msgs ...*message.Message) error {
	err := c.BatchPublisher.PublishBatch(topic, msgs...)
	var be *transport.BatchError
	if errors.As(err, &be) {
		for _, e := range be.Failed {
			if errors.Is(e, amqp.ErrNacked) {
				c.nacks.Add(1)
			}
		}
	}
	return err
}

// RabbitMQ refuses part of a batch: the group's queue
// (x-overflow=reject-publish, x-max-length-bytes) is nearly full, so the
// first event of each aggregate, big, is nacked, while its later ones,
// small, would fit. A consumer that drops duplicates must still apply
// each aggregate in outbox order: nothing of an aggregate may be stored
// ahead of its refused event. Pipelining the whole batch stored the small
// ones, and the consumer applied event 2 before 1. The filler that takes
// the room is consumed only after every big event was refused at least
// once (counted); then the relay's retries get through.
func TestRelayKeepsFirstDeliveryOrderWhenRabbitMQNacks(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := pgtest.New(t, outbox.Migrations())
	tr, err := transport.Open(ctx, transporttest.Config(t, transport.AMQP))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic := "outbox_nack_" + watermill.NewShortUUID()
	const group = "outbox-test"
	transporttest.DeleteAMQPTopology(t, []string{topic}, group)
	ch, queue := fillNackQueue(ctx, t, topic, group)

	// Event 1 of each aggregate is big; events 2..4 are small (about 30
	// bytes each: 12 of them fit the room).
	const aggs, perAgg = 4, 4
	for seq := 1; seq <= perAgg; seq++ {
		for a := range aggs {
			ev := seqEvent{Agg: fmt.Sprintf("agg-%02d", a), Seq: seq}
			if seq == 1 {
				ev.Pad = strings.Repeat("x", nackBig)
			}
			payload, _ := json.Marshal(ev)
			require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: topic, AggregateType: "test", AggregateID: ev.Agg, EventType: "test.seq.v1", Payload: payload}))
		}
	}

	bp, ok := tr.Publisher().(transport.BatchPublisher)
	require.True(t, ok, "the amqp publisher has no PublishBatch")
	pub := &nackCounter{BatchPublisher: bp}
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
	poll.Until(t, time.Minute, func() bool { return pub.nacks.Load() >= aggs },
		"RabbitMQ did not nack the big events: the fault did not happen")

	// Now consume: the filler, then whatever the relay got in.
	require.NoError(t, ch.Qos(100, 0, false))
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	require.NoError(t, err)
	applied := newFirstApplied()
	for len(applied.seen) < aggs*perAgg {
		select {
		case d := <-deliveries:
			if d.Headers["filler"] == true {
				continue
			}
			var ev seqEvent
			require.NoError(t, json.Unmarshal(d.Body, &ev), "body of %s", d.MessageId)
			id, _ := d.Headers["cloudEvents:id"].(string)
			require.NotEmpty(t, id, "delivery without a CloudEvents id: %v", d.Headers)
			applied.apply(t, id, ev, true, "RabbitMQ")
		case <-ctx.Done():
			t.Fatalf("received %d of %d events (%d nacks): %v; arrivals: %v", len(applied.seen), aggs*perAgg, pub.nacks.Load(), ctx.Err(), applied.trace)
		}
	}
	require.NoError(t, outboxtest.WaitDrained(ctx, postgres.From(s.DB)))
	t.Logf("%d nacks; arrivals: %v", pub.nacks.Load(), applied.trace)
}

// nackBig is the payload padding of the events RabbitMQ nacks in
// TestRelayKeepsFirstDeliveryOrderWhenRabbitMQNacks.
const nackBig = 1000

// fillNackQueue declares group's queue of topic, bound as the transport
// binds it, with room for the small events but not a big one while the
// filler it publishes is in it. It returns a channel on the broker and
// the queue's name.
func fillNackQueue(ctx context.Context, t *testing.T, topic, group string) (*amqp091.Channel, string) {
	const limit, room = 20000, 500
	conn, err := amqp091.Dial(transporttest.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	queue := amqp.QueueName(topic, group)
	require.NoError(t, ch.ExchangeDeclare(topic, "fanout", true, false, false, false, nil))
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-max-length-bytes": int32(limit), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(queue, "", topic, false, nil))
	require.NoError(t, ch.Confirm(false))
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false,
		amqp091.Publishing{Body: make([]byte, limit-room), DeliveryMode: amqp091.Persistent, Headers: amqp091.Table{"filler": true}})
	require.NoError(t, err)
	acked, err := dc.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, acked, "the broker refused the filler")
	return ch, queue
}

// Kafka refuses part of a produce request: the in-process Kafka (kfake's
// partition faults; a real broker has no such control) fails, with a
// non-retriable error so that Sarama hands it straight to the relay, the
// records of half the topic's partitions in every other produce request
// while the others are written. A consumer that drops duplicates must
// still apply each aggregate in order. The test fails unless all the
// faults happened.
func TestRelayKeepsFirstDeliveryOrderWhenKafkaRefusesPartOfABatch(t *testing.T) {
	t.Parallel()
	kc := transporttest.FakeKafka(t)
	const faults = 20
	var h *kfake.FaultHandle
	var checks atomic.Int64
	runRelayTransport(t, kc.Config(), 10, 10, func(topic string) {
		h = kc.Cluster.Fault(kfake.Fault{
			Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0, 2, 4, 6},
			Err: kerr.InvalidRecord, Count: faults,
			When: func(kmsg.Request) bool { return checks.Add(1)%2 == 1 },
		})
	})
	require.Equal(t, faults, h.Hits(), "Kafka refused %d produce requests in part, want all %d faults to have happened", h.Hits(), faults)
}

// refuseEveryOtherPublish is a pstest reactor that refuses every other
// Publish RPC to one topic, with a code the client does not retry and the
// transport does not take for permanent (FailedPrecondition: an
// InvalidArgument is, and would rightly fail the row at once), until it
// has refused limit of them.
type refuseEveryOtherPublish struct {
	topic   atomic.Pointer[string]
	limit   int64
	calls   atomic.Int64
	refused atomic.Int64
}

func (r *refuseEveryOtherPublish) React(req any) (bool, any, error) {
	pr, ok := req.(*pubsubpb.PublishRequest)
	topic := r.topic.Load()
	if !ok || topic == nil || !strings.HasSuffix(pr.Topic, "/"+*topic) {
		return false, nil, nil
	}
	if r.calls.Add(1)%2 == 0 && r.refused.Load() < r.limit {
		r.refused.Add(1)
		return true, nil, status.Error(codes.FailedPrecondition, "publish refused by the test")
	}
	return false, nil, nil
}

// Pub/Sub refuses some of the relay's publishes (pstest's reactor; the
// emulator has no such control): every other Publish RPC to the topic, 20
// of them, while the others are stored. The relay publishes several rows
// per Publish call (Pub/Sub has no PublishBatch); a consumer that drops
// duplicates must still apply each aggregate in order. The test fails
// unless all the refusals happened.
func TestRelayKeepsFirstDeliveryOrderWhenPubSubRefusesPublishes(t *testing.T) {
	t.Parallel()
	r := &refuseEveryOtherPublish{limit: 20}
	srv := &embedded.PubSubServer{Server: pstest.NewServer(pstest.ServerReactorOption{FuncName: "Publish", Reactor: r}), ProjectID: "millwright-test"}
	t.Cleanup(func() { _ = srv.Close() })
	runRelayTransport(t, srv.Config(), 10, 5, func(topic string) { r.topic.Store(&topic) })
	require.Equal(t, r.limit, r.refused.Load(), "Pub/Sub refused %d publishes, want all %d refusals to have happened", r.refused.Load(), r.limit)
}
