package nats_test

// The nats kind on the real nats-server (scripts/services.sh up;
// MILLWRIGHT_TEST_NATS_URL): keys in parallel and in order under nacks,
// a handler past AckWait kept in progress, MaxDeliver's end as a dead
// letter, the wire (CloudEvents binary mode, Nats-Msg-Id deduplication),
// the size limit as outbox.Add and the server count it, and the stream
// and consumer settings.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/keyedtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	tnats "github.com/millwright/millwright/transport/nats"
	"github.com/millwright/millwright/transport/transporttest"
)

type ref = keyedtest.Ref

// open opens a nats transport with change applied to the test config.
func open(t *testing.T, change func(c *transport.NATSConfig)) *transport.Transport {
	t.Helper()
	cfg := transporttest.Config(t, transport.NATS)
	cfg.NATS.KeyDrainTimeout = 5 * time.Second
	if change != nil {
		change(&cfg.NATS)
	}
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

// jsClient is a plain JetStream client to look at what the transport made.
func jsClient(t *testing.T) jetstream.JetStream {
	t.Helper()
	nc, err := natsgo.Connect(transporttest.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

// freshTopic is a new topic whose stream is deleted at cleanup.
func freshTopic(t *testing.T) string {
	t.Helper()
	topic := "nats_test_" + watermill.NewShortUUID()
	js := jsClient(t)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), tnats.StreamName(topic)) })
	return topic
}

func keyedMessage(r ref) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(r.String()))
	m.Metadata.Set(metadata.OrderingKey, r.Key)
	return m
}

// publishKeys publishes keys × perKey messages, each key's in order.
func publishKeys(t *testing.T, tr *transport.Transport, topic string, keys, perKey int) {
	t.Helper()
	var msgs []*message.Message
	for s := 0; s < perKey; s++ {
		for k := 0; k < keys; k++ {
			msgs = append(msgs, keyedMessage(ref{Key: fmt.Sprint("k", k), Seq: s}))
		}
	}
	for i := 0; i < len(msgs); i += 500 {
		require.NoError(t, tr.Publisher().(transport.BatchPublisher).PublishBatch(topic, msgs[i:min(i+500, len(msgs))]...))
	}
}

// runRouter consumes topic in group through a Watermill Router.
func runRouter(t *testing.T, tr *transport.Transport, topic, group string, handler message.NoPublishHandlerFunc) {
	t.Helper()
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddNoPublisherHandler("keyed", topic, sub, handler)
	go func() { _ = r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() { _ = r.Close() })
}

// TestKeyedKeysRunInParallel: the first messages of two keys are in their
// handlers at the same time (each waits for the other to start), and a
// key's second message does not start while its first runs.
func TestKeyedKeysRunInParallel(t *testing.T) {
	t.Parallel()
	topic := freshTopic(t)
	tr := open(t, func(c *transport.NATSConfig) { c.KeyParallelism = 2 })
	sub, err := tr.Subscriber("par")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	publishKeys(t, tr, topic, 2, 2)
	first := map[string]chan struct{}{"k0": make(chan struct{}), "k1": make(chan struct{})}
	l := keyedtest.NewLedger()
	runRouter(t, tr, topic, "par", func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		defer l.End(r, true)
		if r.Seq == 0 {
			close(first[r.Key])
			other := first["k1"]
			if r.Key == "k1" {
				other = first["k0"]
			}
			select {
			case <-other:
			case <-time.After(20 * time.Second):
				return fmt.Errorf("%s: the other key's first message never ran beside it", r)
			}
		}
		return nil
	})
	l.WaitCount(t, 4, 40*time.Second)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	require.Empty(t, l.Reorders)
	require.Equal(t, 2, l.MaxActive, "two keys at once")
	for r, n := range l.Started {
		require.Equal(t, 1, n, "%s ran once: neither first message timed out waiting for the other", r)
	}
}

// TestKeyedOrderUnderNacks runs 40 keys × 25 messages through the Router
// with random handler durations and a nack on the first attempt of one
// message in ten: a key's messages start only after their predecessor
// finished, at most KeyParallelism at once, and all finish; a nacked
// message runs again in its key's place.
func TestKeyedOrderUnderNacks(t *testing.T) {
	t.Parallel()
	const keys, perKey, parallelism = 40, 25, 8
	topic := freshTopic(t)
	tr := open(t, func(c *transport.NATSConfig) { c.KeyParallelism = parallelism })
	sub, err := tr.Subscriber("order")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	publishKeys(t, tr, topic, keys, perKey)
	l := keyedtest.NewLedger()
	var nacks atomic.Int64
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewPCG(seed, 1))
	var rmu sync.Mutex
	runRouter(t, tr, topic, "order", func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		rmu.Lock()
		d := time.Duration(rnd.IntN(3000)) * time.Microsecond
		fail := rnd.IntN(10) == 0
		rmu.Unlock()
		time.Sleep(d) // the handler's simulated work, not synchronisation
		l.Mu.Lock()
		fail = fail && l.Started[r] == 1
		l.Mu.Unlock()
		l.End(r, !fail)
		if fail {
			nacks.Add(1)
			return fmt.Errorf("transient failure of %s", r)
		}
		return nil
	})
	l.WaitCount(t, keys*perKey, 2*time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("nacks %d, most at once %d, duplicates %d", nacks.Load(), l.MaxActive, l.Duplicates)
	require.Positive(t, nacks.Load(), "some messages were nacked")
	require.Empty(t, l.Reorders)
	require.LessOrEqual(t, l.MaxActive, parallelism)
	require.Greater(t, l.MaxActive, 1, "keys ran in parallel")
}

// TestHandlerPastAckWaitIsKeptInProgress: with AckWait 1 s, a handler that
// runs 3.5 s (its message and the key's next one, waiting behind it, are
// held that long) is not overtaken by a redelivery: the consumer
// delivered each message exactly once.
func TestHandlerPastAckWaitIsKeptInProgress(t *testing.T) {
	t.Parallel()
	topic := freshTopic(t)
	tr := open(t, func(c *transport.NATSConfig) { c.AckWait = time.Second; c.KeyParallelism = 4 })
	sub, err := tr.Subscriber("slow")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	publishKeys(t, tr, topic, 1, 2)
	l := keyedtest.NewLedger()
	var slowest atomic.Int64
	runRouter(t, tr, topic, "slow", func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		start := time.Now()
		if r.Seq == 0 {
			time.Sleep(3500 * time.Millisecond) // the slow work past AckWait, not synchronisation
		}
		slowest.Store(max(slowest.Load(), int64(time.Since(start))))
		l.Finish(r)
		return nil
	})
	l.WaitCount(t, 2, 30*time.Second)
	require.Greater(t, time.Duration(slowest.Load()), 3*time.Second, "the handler outlived AckWait (1 s) threefold")
	js := jsClient(t)
	var info *jetstream.ConsumerInfo
	require.Eventually(t, func() bool {
		c, err := js.Consumer(context.Background(), tnats.StreamName(topic), tnats.ConsumerName("slow"))
		if err != nil {
			return false
		}
		info, err = c.Info(context.Background())
		return err == nil && info.NumAckPending == 0
	}, 10*time.Second, 50*time.Millisecond, "both messages acknowledged")
	require.Equal(t, uint64(2), info.Delivered.Consumer, "each message delivered once: no redelivery after AckWait while it was held")
	l.Mu.Lock()
	defer l.Mu.Unlock()
	require.Empty(t, l.Reorders)
	require.Zero(t, l.Duplicates)
}

// TestMaxDeliverEndsInDeadLetter: with MaxDeliver 2 and AckWait 1 s, a
// consumer takes a message and stops without acknowledging it (its
// handler still running past the drain bound, as a consumer that died);
// the server delivers it a second, last time, and the next consumer
// sends it to DeadLetterTopic with its context instead of running it: it
// is not dropped.
func TestMaxDeliverEndsInDeadLetter(t *testing.T) {
	t.Parallel()
	topic, dead := freshTopic(t), freshTopic(t)
	change := func(c *transport.NATSConfig) {
		c.AckWait = time.Second
		c.MaxDeliver = 2
		c.DeadLetterTopic = dead
		c.KeyDrainTimeout = 10 * time.Millisecond
	}
	tr1 := open(t, change)
	sub1, err := tr1.Subscriber("dl")
	require.NoError(t, err)
	deadSub, err := tr1.Subscriber("inspect")
	require.NoError(t, err)
	require.NoError(t, deadSub.(message.SubscribeInitializer).SubscribeInitialize(dead))
	m := keyedMessage(ref{Key: "k", Seq: 0})
	m.Metadata.Set(metadata.EventType, "test.dead.v1")
	ctx1, cancel1 := context.WithCancel(context.Background())
	msgs, err := sub1.Subscribe(ctx1, topic)
	require.NoError(t, err)
	require.NoError(t, tr1.Publisher().Publish(topic, m))
	got := <-msgs // held, never acked: the first delivery
	require.Equal(t, m.UUID, got.UUID)
	cancel1() // the drain bound passes with it unacked: it is left to AckWait

	tr2 := open(t, change)
	sub2, err := tr2.Subscriber("dl")
	require.NoError(t, err)
	ran := make(chan string, 1)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	msgs2, err := sub2.Subscribe(ctx2, topic)
	require.NoError(t, err)
	go func() {
		for m := range msgs2 {
			ran <- m.UUID
			m.Ack()
		}
	}()
	dl, err := deadSub.Subscribe(ctx2, dead)
	require.NoError(t, err)
	select {
	case d := <-dl:
		require.Equal(t, m.UUID, d.UUID)
		require.Equal(t, "k:0", string(d.Payload))
		require.Equal(t, topic, d.Metadata.Get(tnats.MetadataDeadLetterTopic))
		require.Equal(t, "dl", d.Metadata.Get(tnats.MetadataDeadLetterGroup))
		require.Equal(t, "2", d.Metadata.Get(tnats.MetadataDeadLetterDeliveries))
		require.Contains(t, d.Metadata.Get(tnats.MetadataDeadLetterReason), "MaxDeliver 2")
		require.Equal(t, "test.dead.v1", d.Metadata.Get(metadata.EventType))
		require.Equal(t, "k", d.Metadata.Get(metadata.OrderingKey))
		d.Ack()
	case id := <-ran:
		t.Fatalf("the message's last delivery ran the handler (%s) instead of reaching the dead letter topic", id)
	case <-time.After(30 * time.Second):
		t.Fatal("no dead letter 30 s after the first consumer stopped holding the message (AckWait 1 s)")
	}
}

// TestWireIsCloudEventsBinaryWithMsgID: the headers a plain NATS client
// sees are the CloudEvents NATS binding's (ce-id, ce-type,
// content-type), traceparent under its own name, the Watermill UUID
// header and Nats-Msg-Id; a republish of the same UUID is dropped by the
// stream's duplicate window.
func TestWireIsCloudEventsBinaryWithMsgID(t *testing.T) {
	t.Parallel()
	topic := freshTopic(t)
	tr := open(t, nil)
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"a":1}`))
	m.Metadata.Set(metadata.EventID, m.UUID)
	m.Metadata.Set(metadata.EventType, "test.wire.v1")
	m.Metadata.Set(metadata.EventDataContentType, "application/json")
	m.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	require.NoError(t, tr.Publisher().Publish(topic, m))
	require.NoError(t, tr.Publisher().Publish(topic, m.Copy()), "a republish is acknowledged")
	js := jsClient(t)
	s, err := js.Stream(context.Background(), tnats.StreamName(topic))
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.State.Msgs, "the duplicate window dropped the republish")
	replay := m.Copy()
	replay.Metadata.Set(metadata.DeadLetterReplayOf, "17")
	require.NoError(t, tr.Publisher().Publish(topic, replay))
	info, err = s.Info(context.Background())
	require.NoError(t, err)
	require.Equal(t, uint64(2), info.State.Msgs, "a replayed dead letter (same event id) is not a duplicate")
	raw, err := s.GetMsg(context.Background(), 1)
	require.NoError(t, err)
	require.Equal(t, m.UUID, raw.Header.Get("ce-id"))
	require.Equal(t, "test.wire.v1", raw.Header.Get("ce-type"))
	require.Equal(t, "application/json", raw.Header.Get("content-type"))
	require.Equal(t, m.Metadata.Get("traceparent"), raw.Header.Get("traceparent"))
	require.Equal(t, m.UUID, raw.Header.Get("Nats-Msg-Id"))
	require.Equal(t, m.UUID, raw.Header.Get(tnats.UUIDHeader))

	replayed, err := s.GetMsg(context.Background(), 2)
	require.NoError(t, err)
	require.Equal(t, m.UUID+"-replay-17", replayed.Header.Get("Nats-Msg-Id"))

	sub, err := tr.Subscriber("wire")
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := <-msgs
	got.Ack()
	require.Equal(t, m.UUID, got.UUID)
	for _, k := range []string{metadata.EventID, metadata.EventType, metadata.EventDataContentType, "traceparent"} {
		require.Equal(t, m.Metadata.Get(k), got.Metadata.Get(k), k)
	}
	for k := range got.Metadata {
		require.False(t, strings.HasPrefix(k, "Nats-"), "JetStream header %s is not metadata", k)
	}
}

// TestSizeLimitMatchesTheServer: the largest message Limits (what
// outbox.Add checks) accepts is stored by the server; one byte more is
// refused by Limits and, published anyway, by the client's max_payload
// check, as a permanent ErrMessageTooLarge.
func TestSizeLimitMatchesTheServer(t *testing.T) {
	t.Parallel()
	topic := freshTopic(t)
	tr := open(t, nil)
	lim := tr.Limits()
	require.Equal(t, transport.NATSMaxMessageBytes, lim.MaxBytes)
	id := watermill.NewUUID()
	md := map[string]string{metadata.EventID: id, metadata.EventType: "test.size.v1", metadata.OrderingKey: "k"}
	n := lim.MaxBytes - lim.Size(topic, id, nil, md)
	fits := make([]byte, n)
	require.NoError(t, lim.Check(topic, id, fits, md))
	m := message.NewMessage(id, fits)
	for k, v := range md {
		m.Metadata.Set(k, v)
	}
	require.NoError(t, tr.Publisher().Publish(topic, m), "the largest message Limits accepts")

	id2 := watermill.NewUUID()
	md[metadata.EventID] = id2
	over := make([]byte, n+1)
	err := lim.Check(topic, id2, over, md)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	m2 := message.NewMessage(id2, over)
	for k, v := range md {
		m2.Metadata.Set(k, v)
	}
	err = tr.Publisher().Publish(topic, m2)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	require.True(t, transport.IsPermanent(err), "%v", err)
}

// TestStreamAndConsumerSettings: Subscribe creates the stream and the
// group's durable consumer with the documented settings, and doing it
// again (another subscriber, another process) changes nothing.
func TestStreamAndConsumerSettings(t *testing.T) {
	t.Parallel()
	topic := freshTopic(t) + ".with.dots"
	js := jsClient(t)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), tnats.StreamName(topic)) })
	for range 2 {
		tr := open(t, func(c *transport.NATSConfig) { c.KeyParallelism = 100 })
		sub, err := tr.Subscriber("billing.v2")
		require.NoError(t, err)
		require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	}
	s, err := js.Stream(context.Background(), tnats.StreamName(topic))
	require.NoError(t, err)
	si := s.CachedInfo()
	require.Equal(t, []string{topic}, si.Config.Subjects)
	require.Equal(t, jetstream.FileStorage, si.Config.Storage)
	require.Equal(t, jetstream.LimitsPolicy, si.Config.Retention)
	require.Equal(t, 1, si.Config.Replicas)
	require.Equal(t, tnats.DefaultDuplicateWindow, si.Config.Duplicates)
	require.Equal(t, tnats.DefaultMaxAge, si.Config.MaxAge)
	c, err := s.Consumer(context.Background(), tnats.ConsumerName("billing.v2"))
	require.NoError(t, err)
	ci := c.CachedInfo()
	require.Equal(t, tnats.ConsumerName("billing.v2"), ci.Config.Durable)
	require.Equal(t, jetstream.AckExplicitPolicy, ci.Config.AckPolicy)
	require.Equal(t, jetstream.DeliverAllPolicy, ci.Config.DeliverPolicy)
	require.Equal(t, tnats.DefaultAckWait, ci.Config.AckWait)
	require.Equal(t, 1600, ci.Config.MaxAckPending, "16 × KeyParallelism")
	require.Equal(t, -1, ci.Config.MaxDeliver)
	require.Equal(t, topic, ci.Config.FilterSubject)
	require.NotEqual(t, tnats.StreamName("a.b"), tnats.StreamName("a_b"), "dotted names do not collide")
}

// TestOpenRefusesWhatCannotWork: configuration errors name the field.
func TestOpenRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		change func(c *transport.NATSConfig)
		want   string
	}{
		{func(c *transport.NATSConfig) { c.MaxDeliver = 3 }, "MaxDeliver 3 without DeadLetterTopic"},
		{func(c *transport.NATSConfig) { c.AckWait = time.Millisecond }, "AckWait"},
		{func(c *transport.NATSConfig) { c.KeyParallelism = 10; c.MaxAckPending = 5 }, "MaxAckPending 5 is below KeyParallelism 10"},
		{func(c *transport.NATSConfig) { c.URL = "" }, "URL is empty"},
	} {
		cfg := transporttest.Config(t, transport.NATS)
		tc.change(&cfg.NATS)
		_, err := transport.Open(context.Background(), cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := transport.ParseURL("nats://127.0.0.1:4222")
	require.NoError(t, err)
	cfg := transport.Config{Kind: transport.NATS}
	cfg.NATS.URL = "nats://127.0.0.1:1"
	cfg.WaitForBroker = transport.NoWait
	_, err = transport.Open(context.Background(), cfg)
	require.Error(t, err)
	require.False(t, errors.Is(err, context.Canceled))
	require.Contains(t, err.Error(), "nats://127.0.0.1:1")
}

// TestOneMemberAtATimeThenTakeover: two members of a group (two
// transports, as two processes) on one topic: only the pinned one
// receives. "graceful": it ends its subscription holding messages, naks
// them (confirmed) and unpins, and the other takes over at once.
// "stalled": it stops holding a message its handler never finishes (as a
// member that died), so nothing is nak'ed and the pin stays; the server
// redelivers the held messages after AckWait (1 s), not in stream order,
// and pins the other member after PinnedTTL (7 s). Either way every key's
// first copies stay in order across the handover.
func TestOneMemberAtATimeThenTakeover(t *testing.T) {
	t.Parallel()
	for _, crash := range []bool{false, true} {
		name := "graceful"
		if crash {
			name = "stalled"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testTakeover(t, crash)
		})
	}
}

func testTakeover(t *testing.T, crash bool) {
	const keys, perKey, firstTakes = 4, 5, 6
	topic := freshTopic(t)
	change := func(c *transport.NATSConfig) {
		c.KeyParallelism = 4
		if crash {
			c.AckWait = time.Second
			c.KeyDrainTimeout = 10 * time.Millisecond
		}
	}
	tr1, tr2 := open(t, change), open(t, change)
	sub1, err := tr1.Subscriber("members")
	require.NoError(t, err)
	require.NoError(t, sub1.(message.SubscribeInitializer).SubscribeInitialize(topic))
	publishKeys(t, tr1, topic, keys, perKey)

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	msgs1, err := sub1.Subscribe(ctx1, topic)
	require.NoError(t, err)
	var arrivals []string
	first := <-msgs1 // sub1 pulls, and holds the pin
	arrivals = append(arrivals, string(first.Payload))
	first.Ack()

	sub2, err := tr2.Subscriber("members")
	require.NoError(t, err)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	msgs2, err := sub2.Subscribe(ctx2, topic)
	require.NoError(t, err)
	for len(arrivals) < firstTakes {
		select {
		case m := <-msgs1:
			arrivals = append(arrivals, string(m.Payload))
			m.Ack()
		case m := <-msgs2:
			t.Fatalf("the standby member received %s while the pinned one was consuming", m.Payload)
		case <-time.After(30 * time.Second):
			t.Fatalf("the pinned member received %d of %d", len(arrivals), firstTakes)
		}
	}
	cancel1() // ends holding unacked messages: they are nak'ed and the pin handed on
	for m := range msgs1 {
		if !crash {
			m.Nack() // handed out as the subscription ended: not handled here
		}
	}
	seen := map[string]bool{}
	for _, a := range arrivals {
		seen[a] = true
	}
	deadline := time.After(30 * time.Second)
	for len(seen) < keys*perKey {
		select {
		case m := <-msgs2:
			arrivals = append(arrivals, string(m.Payload))
			seen[string(m.Payload)] = true
			m.Ack()
		case <-deadline:
			t.Fatalf("after the handover the group has %d of %d messages; arrivals %v", len(seen), keys*perKey, arrivals)
		}
	}
	// The first copy of each message comes in its key's order.
	next := map[string]int{}
	firstCopy := map[string]bool{}
	for _, a := range arrivals {
		if firstCopy[a] {
			continue
		}
		firstCopy[a] = true
		r, ok := keyedtest.ParseRef(a)
		require.True(t, ok, a)
		require.Equal(t, next[r.Key], r.Seq, "key %s out of order across the handover; arrivals %v", r.Key, arrivals)
		next[r.Key]++
	}
}

// TestMetricsShowTheGroupsLag: with a Registerer, the stream's messages
// and the group's pending (its lag), then its unacknowledged messages,
// are read from the server.
func TestMetricsShowTheGroupsLag(t *testing.T) {
	tnats.SetMetricsInterval(50 * time.Millisecond) // not parallel: a package variable
	defer tnats.SetMetricsInterval(10 * time.Second)
	topic := freshTopic(t)
	reg := prometheus.NewRegistry()
	tr := open(t, func(c *transport.NATSConfig) { c.Registerer = reg })
	sub, err := tr.Subscriber("lag")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	publishKeys(t, tr, topic, 1, 3)
	gauge := func(name string) float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == name && len(mf.GetMetric()) > 0 {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}
	require.Eventually(t, func() bool {
		return gauge(tnats.MetricStreamMessages) == 3 && gauge(tnats.MetricConsumerPending) == 3
	}, 30*time.Second, 20*time.Millisecond, "stream 3 messages, group lag 3")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	held := <-msgs // delivered, not acknowledged
	require.Eventually(t, func() bool {
		return gauge(tnats.MetricConsumerAckPending) >= 1 && gauge(tnats.MetricConsumerPending) < 3
	}, 30*time.Second, 20*time.Millisecond, "one held unacknowledged, the lag down")
	held.Ack()
}

// TestBadSubjectIsRefusedForGood: a topic with an empty subject token is
// refused by the name check (outbox.Add's Limits too), permanently.
func TestBadSubjectIsRefusedForGood(t *testing.T) {
	t.Parallel()
	tr := open(t, nil)
	for _, topic := range []string{"orders..created", "orders."} {
		err := tr.Limits().ValidateTopic(topic)
		require.ErrorIs(t, err, transport.ErrInvalidName, topic)
		err = tr.Publisher().Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x")))
		require.ErrorIs(t, err, transport.ErrInvalidName, topic)
		require.True(t, transport.IsPermanent(err), "%v", err)
	}
	require.NoError(t, tr.Limits().ValidateTopic("orders.created.v1"))
}
