package amqp_test

// The key-parallel consumer (Config.KeyParallelism) on the real RabbitMQ:
// keys in parallel, one key in order under random handler durations and
// nacks, no ack before the handler finished (a consumer SIGKILLed with
// handlers running: RabbitMQ redelivers exactly its unfinished work, each
// key in order), and a connection cut mid-stream.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/keyedtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// ref names one published message (the shared keyed-test harness's,
// internal/testing/keyedtest).
type ref = keyedtest.Ref

// keyedTopic declares group's queue on a fresh topic and publishes keys ×
// perKey messages (payload "key:seq", the key as metadata.OrderingKey),
// each key's in order.
func keyedTopic(t *testing.T, group string, keys, perKey int) string {
	t.Helper()
	topic := freshTopic(t, group)
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), DeclareGroups: []string{group}}, nil)
	require.NoError(t, err)
	defer tr.Close()
	var msgs []*message.Message
	for s := 0; s < perKey; s++ {
		for k := 0; k < keys; k++ {
			msgs = append(msgs, keyedMessage(ref{Key: fmt.Sprint("k", k), Seq: s}))
		}
	}
	for i := 0; i < len(msgs); i += 500 {
		require.NoError(t, tr.Publisher().(transport.BatchPublisher).PublishBatch(topic, msgs[i:min(i+500, len(msgs))]...))
	}
	return topic
}

func keyedMessage(r ref) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(r.String()))
	m.Metadata.Set(metadata.OrderingKey, r.Key)
	return m
}

// keyedTransport opens a transport with the key-parallel consumer.
func keyedTransport(t *testing.T, url string, parallelism int) *amqp.Transport {
	t.Helper()
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: url, KeyParallelism: parallelism, KeyDrainTimeout: 5 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

// runRouter consumes topic in group through a Watermill Router running
// handler, and returns the router's close function.
func runRouter(t *testing.T, tr *amqp.Transport, topic, group string, handler message.NoPublishHandlerFunc) func() {
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
	var once sync.Once
	stop := func() { once.Do(func() { _ = r.Close() }) }
	t.Cleanup(stop)
	return stop
}

// TestKeyedKeysRunInParallel: the first messages of two keys are in their
// handlers at the same time (each waits for the other to start), and a
// key's second message does not start while its first runs. With
// KeyParallelism 1 (or watermill-amqp's subscriber) the two never meet.
func TestKeyedKeysRunInParallel(t *testing.T) {
	t.Parallel()
	const group = "par"
	topic := keyedTopic(t, group, 2, 2)
	tr := keyedTransport(t, transporttest.AMQPURL(), 2)
	first := map[string]chan struct{}{"k0": make(chan struct{}), "k1": make(chan struct{})}
	l := keyedtest.NewLedger()
	runRouter(t, tr, topic, group, func(m *message.Message) error {
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
// message in ten: every key's messages start only after their
// predecessor finished, never two of a key at once, at most
// KeyParallelism at once, and all finish; a nacked message is run again
// in its key's place (the checks above would catch it falling behind).
func TestKeyedOrderUnderNacks(t *testing.T) {
	t.Parallel()
	const group, keys, perKey, parallelism = "order", 40, 25, 8
	topic := keyedTopic(t, group, keys, perKey)
	tr := keyedTransport(t, transporttest.AMQPURL(), parallelism)
	l := keyedtest.NewLedger()
	var nacks atomic.Int64
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewPCG(seed, 1))
	var rmu sync.Mutex
	runRouter(t, tr, topic, group, func(m *message.Message) error {
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

// envKeyedChild makes this test binary the consumer process that
// TestKeyedConsumerKilled kills: its JSON keyedChild.
const envKeyedChild = "MILLWRIGHT_TEST_AMQP_KEYED_CHILD"

type keyedChild struct {
	URL, Topic, Group string
	Parallelism       int
	// Block lists "key:seq" messages whose handler never returns.
	Block []string
}

// TestKeyedChildProcess is the consumer process of TestKeyedConsumerKilled;
// it does nothing in a normal run. It prints "done key:seq" as each
// handler finishes, before its ack.
func TestKeyedChildProcess(t *testing.T) {
	var c keyedChild
	if !keyedtest.ChildSpec(t, envKeyedChild, &c) {
		t.Skip("only as TestKeyedConsumerKilled's child process")
	}
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: c.URL, KeyParallelism: c.Parallelism}, nil)
	require.NoError(t, err)
	sub, err := tr.Subscriber(c.Group)
	require.NoError(t, err)
	keyedtest.RunChild(t, sub, c.Topic, c.Block)
}

// TestKeyedConsumerKilled SIGKILLs a key-parallel consumer while three of
// its handlers hang and its other keys have run ahead: RabbitMQ must give
// a successor every message the child did not finish (the hanging ones
// included: nothing was acked before its handler finished), at most a
// few it did finish (acks in flight at the kill), and the successor, as a
// deduplicating consumer, applies every key in order.
func TestKeyedConsumerKilled(t *testing.T) {
	t.Parallel()
	const group, keys, perKey, parallelism = "kill", 30, 20, 8
	topic := keyedTopic(t, group, keys, perKey)
	block := []string{"k1:2", "k7:3", "k12:1"}
	cmd, lines, stderr := keyedtest.StartChild(t, envKeyedChild, keyedChild{URL: transporttest.AMQPURL(), Topic: topic, Group: group, Parallelism: parallelism, Block: block})
	childDone := map[ref]bool{}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	keyedtest.WaitDone(ctx, t, lines, childDone, (keys-len(block))*perKey/2, stderr)
	keyedtest.Kill(t, cmd, lines, childDone)
	for _, b := range block {
		r, _ := keyedtest.ParseRef(b)
		require.False(t, childDone[r], "blocked %s finished", r)
		require.True(t, childDone[ref{Key: r.Key, Seq: r.Seq - 1}], "the fault: %s's predecessor finished before the kill", r)
	}
	t.Logf("killed after %d finished messages", len(childDone))

	l := keyedtest.NewLedger()
	for r := range childDone {
		l.Done[r] = true
	}
	tr := keyedTransport(t, transporttest.AMQPURL(), parallelism)
	var redelivered sync.Map
	runRouter(t, tr, topic, group, func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		redelivered.Store(r, true)
		l.Start(r)
		l.End(r, true)
		return nil
	})
	l.WaitCount(t, keys*perKey, 2*time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	for k := 0; k < keys; k++ {
		for s := 0; s < perKey; s++ {
			r := ref{Key: fmt.Sprint("k", k), Seq: s}
			if _, ok := redelivered.Load(r); !childDone[r] && !ok {
				t.Errorf("%s, unfinished by the child, never reached the successor", r)
			}
		}
	}
	t.Logf("reorders %d, redelivered though finished %d", len(l.Reorders), l.Duplicates)
	require.Empty(t, l.Reorders)
	require.LessOrEqual(t, l.Duplicates, 2*parallelism, "only unfinished work (and acks in flight at the kill) is redelivered")
}

// TestKeyedConnectionCut cuts the consumer's connection (a faultproxy
// between it and RabbitMQ) while one handler hangs: the subscriber
// reconnects, the other keys go on, the hanging message's key waits for
// its handler (its redelivered messages do not run beside it), and once
// it returns every message is finished, each key in order for a
// deduplicating consumer.
func TestKeyedConnectionCut(t *testing.T) {
	t.Parallel()
	const group, keys, perKey = "cut", 10, 20
	topic := keyedTopic(t, group, keys, perKey)
	proxy, through := proxied(t)
	tr := keyedTransport(t, through, 4)
	hang, release := ref{Key: "k3", Seq: 2}, make(chan struct{})
	hanging := make(chan struct{})
	l := keyedtest.NewLedger()
	runRouter(t, tr, topic, group, func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		if r == hang {
			select {
			case <-hanging:
			default:
				close(hanging)
				<-release
			}
		}
		time.Sleep(time.Millisecond) // the handler's simulated work
		l.End(r, true)
		return nil
	})
	select {
	case <-hanging:
	case <-time.After(time.Minute):
		t.Fatal("the hanging message never ran")
	}
	before := l.Count()
	proxy.Cut()
	require.Positive(t, proxy.CutConns(), "the cut closed the consumer's connection")
	// Messages published after the cut arrive: the subscriber reconnected.
	pubTr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL()}, nil)
	require.NoError(t, err)
	defer pubTr.Close()
	for s := 0; s < 5; s++ {
		require.NoError(t, pubTr.Publisher().Publish(topic, keyedMessage(ref{Key: "after", Seq: s})))
	}
	require.Eventually(t, func() bool {
		l.Mu.Lock()
		defer l.Mu.Unlock()
		return l.Done[ref{Key: "after", Seq: 4}]
	}, time.Minute, 10*time.Millisecond, "a message published after the cut is handled")
	l.Mu.Lock()
	require.False(t, l.Done[hang], "still hanging")
	for s := hang.Seq + 1; s < perKey; s++ {
		require.Zero(t, l.Started[ref{Key: hang.Key, Seq: s}], "%s:%d started while its predecessor hangs", hang.Key, s)
	}
	l.Mu.Unlock()
	close(release)
	l.WaitCount(t, keys*perKey+5, time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("finished %d before the cut; reorders %d, duplicates %d", before, len(l.Reorders), l.Duplicates)
	require.Empty(t, l.Reorders)
	require.Positive(t, l.Started[hang], "the hanging message ran")
	require.Positive(t, l.Duplicates, "the cut lost the hanging message's ack: RabbitMQ redelivered it")
}

// TestKeyedCloseDrains closes the subscriber while two handlers run:
// Close waits for the one that finishes within KeyDrainTimeout and acks
// it; the one that does not has its message's context cancelled and is
// redelivered to the next consumer, and Close returns within the bound.
func TestKeyedCloseDrains(t *testing.T) {
	t.Parallel()
	const group = "drain"
	topic := keyedTopic(t, group, 2, 1) // k0:0, k1:0
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), KeyParallelism: 2, KeyDrainTimeout: 2 * time.Second}, nil)
	require.NoError(t, err)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	out := map[string]*message.Message{}
	for len(out) < 2 {
		select {
		case m := <-msgs:
			out[string(m.Payload)] = m
		case <-time.After(30 * time.Second):
			t.Fatal("both messages out")
		}
	}
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- tr.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a handler ran", err)
	case <-out["k1:0"].Context().Done():
		t.Fatal("a running message's context was cancelled before the drain bound")
	default:
	}
	require.True(t, out["k0:0"].Ack())
	select {
	case <-out["k1:0"].Context().Done(): // the bound passed: cancelled
	case <-time.After(30 * time.Second):
		t.Fatal("the unfinished message's context was never cancelled")
	}
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return after the drain bound")
	}
	require.GreaterOrEqual(t, time.Since(start), 2*time.Second, "Close waited for the drain bound")
	_, ok := <-msgs
	require.False(t, ok, "the output channel is closed")

	// The next consumer gets only the unfinished message.
	next := keyedTransport(t, transporttest.AMQPURL(), 2)
	sub2, err := next.Subscriber(group)
	require.NoError(t, err)
	msgs2, err := sub2.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	select {
	case m := <-msgs2:
		require.Equal(t, "k1:0", string(m.Payload))
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the unfinished message was not redelivered")
	}
	// A marker published now comes next: k0:0, acked at drain, does not.
	require.NoError(t, next.Publisher().Publish(topic, keyedMessage(ref{Key: "marker", Seq: 0})))
	select {
	case m := <-msgs2:
		require.Equal(t, "marker:0", string(m.Payload), "k0:0 was acked by the drain")
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the marker never arrived")
	}
}

// TestKeyedCloseWithSilentBroker: with RabbitMQ's replies held back (a
// faultproxy's Hold: the broker gets the client's requests, the client
// none of the answers), Close still returns, each wait bounded by
// ConnectTimeout.
func TestKeyedCloseWithSilentBroker(t *testing.T) {
	t.Parallel()
	const group = "silent"
	topic := keyedTopic(t, group, 1, 1)
	proxy, through := proxied(t)
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: through, KeyParallelism: 2, ConnectTimeout: time.Second}, nil)
	require.NoError(t, err)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	select {
	case m := <-msgs:
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("no message")
	}
	proxy.Hold()
	defer proxy.Release()
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- sub.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return with the broker silent")
	}
	t.Logf("Close returned after %s", time.Since(start).Round(time.Millisecond))
	require.Positive(t, proxy.HeldReads(), "the broker's replies were held back")
	_ = tr.Close()
}

// TestKeyedHalfOpenKeepsKeyOrder makes the consumer's connection
// half-open while every key has deliveries in flight (a faultproxy resets
// the client's end and keeps RabbitMQ's open and unanswered, as a dropped
// NAT or conntrack entry does): the subscriber reconnects at once, but
// RabbitMQ holds the old connection's unacked deliveries until its
// heartbeat timeout closes it. No new consumer may get the queue's later
// deliveries meanwhile (the consume is exclusive), so every key is applied
// in order by a deduplicating consumer, and all are applied once RabbitMQ
// dropped the old connection.
func TestKeyedHalfOpenKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	const group, keys, perKey = "halfopen", 10, 40
	topic := keyedTopic(t, group, keys, perKey)
	proxy, through := proxied(t)
	tr := keyedTransport(t, through, 4)
	l := keyedtest.NewLedger()
	runRouter(t, tr, topic, group, func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		time.Sleep(20 * time.Millisecond) // the handler's simulated work: deliveries queue up behind their keys
		l.End(r, true)
		return nil
	})
	l.WaitCount(t, keys*perKey/4, time.Minute)
	accepted := proxy.Accepted()
	faultAt := time.Now()
	require.Positive(t, proxy.HalfOpen(), "the fault: the consumer's connection is half-open")
	// The fault: the client reconnected while RabbitMQ still held its old
	// connection (and that connection's unacked deliveries).
	require.Eventually(t, func() bool { return proxy.Accepted() > accepted }, time.Minute, time.Millisecond, "the subscriber reconnects")
	require.Positive(t, proxy.HalfOpenLive(), "RabbitMQ still holds the old connection when the subscriber reconnects")
	l.WaitCount(t, keys*perKey, 3*time.Minute)
	require.Eventually(t, func() bool { return proxy.HalfOpenLive() == 0 }, 2*time.Minute, 10*time.Millisecond, "RabbitMQ drops the half-open connection")
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("all %d applied %s after the fault; reorders %d, duplicates %d", keys*perKey, time.Since(faultAt).Round(time.Millisecond), len(l.Reorders), l.Duplicates)
	require.Empty(t, l.Reorders, "a key applied out of order across the half-open connection")
}

// TestKeyedSurvivesAPanic: reading one delivery panics (the first time):
// the subscriber recovers it, counts it, runs the delivery again in its
// key's place, and every message is handled, each key in order, by the
// same subscriber (the process and the subscription go on).
func TestKeyedSurvivesAPanic(t *testing.T) {
	t.Parallel()
	const group, keys, perKey = "panic", 3, 5
	topic := keyedTopic(t, group, keys, perKey)
	tr := keyedTransport(t, transporttest.AMQPURL(), 2)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	var once atomic.Bool
	amqp.SetKeyedUnmarshal(sub, func(d amqp091.Delivery) (*message.Message, error) {
		if string(d.Body) == "k1:2" && once.CompareAndSwap(false, true) {
			var m map[string]int
			m["boom"]++ // a runtime panic in the subscriber's own goroutine
		}
		return amqp.Marshaler{}.Unmarshal(d)
	})
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	l := keyedtest.NewLedger()
	go func() {
		for m := range msgs {
			r, _ := keyedtest.ParseRef(string(m.Payload))
			go func() { // as the Router does: each message in its own goroutine
				l.Start(r)
				l.End(r, true)
				m.Ack()
			}()
		}
	}()
	l.WaitCount(t, keys*perKey, time.Minute)
	require.Equal(t, int64(1), sub.(*amqp.KeyedSubscriber).Panics(), "the fault: one panic, recovered")
	l.Mu.Lock()
	defer l.Mu.Unlock()
	require.Empty(t, l.Reorders)
	require.Equal(t, 1, l.Started[ref{Key: "k1", Seq: 2}], "the delivery that panicked was handed out once it read")
}

// TestKeyedReconnectFreesASlowKeysSlots: one key's first message hangs
// while its 14 later messages wait behind it, holding 15 of the 20
// deliveries in flight (Prefetch); the other keys go on through the rest.
// The connection is then cut: RabbitMQ requeues every unacked delivery and
// sends them again on the new channel. The lost channel's waiting
// deliveries must give their slots back at once (RabbitMQ has them
// again), not only when the hanging handler returns; else they and the
// key's redeliveries fill every slot and the other keys stall behind one
// slow handler.
func TestKeyedReconnectFreesASlowKeysSlots(t *testing.T) {
	t.Parallel()
	const group, keys, perKey, slowN = "slots", 10, 10, 15
	topic := freshTopic(t, group)
	pubTr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), DeclareGroups: []string{group}}, nil)
	require.NoError(t, err)
	defer pubTr.Close()
	var msgs []*message.Message
	for s := 0; s < slowN; s++ {
		msgs = append(msgs, keyedMessage(ref{Key: "slow", Seq: s}))
	}
	// One Publish: the slow key's messages at the head of the queue, in a row.
	require.NoError(t, pubTr.Publisher().Publish(topic, msgs...))
	msgs = nil
	for s := 0; s < perKey; s++ {
		for k := 0; k < keys; k++ {
			msgs = append(msgs, keyedMessage(ref{Key: fmt.Sprint("k", k), Seq: s}))
		}
	}
	require.NoError(t, pubTr.Publisher().(transport.BatchPublisher).PublishBatch(topic, msgs...))

	proxy, through := proxied(t)
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: through, KeyParallelism: 4, Prefetch: 20, KeyDrainTimeout: 5 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	hang, release := ref{Key: "slow", Seq: 0}, make(chan struct{})
	hanging := make(chan struct{})
	l := keyedtest.NewLedger()
	runRouter(t, tr, topic, group, func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		if r == hang {
			select {
			case <-hanging:
			default:
				close(hanging)
				<-release
			}
		}
		time.Sleep(time.Millisecond) // the handler's simulated work
		l.End(r, true)
		return nil
	})
	select {
	case <-hanging:
	case <-time.After(time.Minute):
		t.Fatal("the hanging message never ran")
	}
	l.WaitCount(t, 10, time.Minute) // the other keys go on beside it
	proxy.Cut()
	require.Positive(t, proxy.CutConns(), "the fault: the consumer's connection was cut")
	others := func() int {
		l.Mu.Lock()
		defer l.Mu.Unlock()
		n := 0
		for r := range l.Done {
			if r.Key != hang.Key {
				n++
			}
		}
		return n
	}
	deadline := time.Now().Add(time.Minute) // fails a stall, not a slow machine
	for others() < keys*perKey && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling the ledger
	}
	done := others()
	l.Mu.Lock()
	hungStill := !l.Done[hang]
	l.Mu.Unlock()
	close(release)
	require.True(t, hungStill, "the slow key's handler still hung while the others ran")
	require.Equal(t, keys*perKey, done, "the other keys stalled behind the slow key's handler after the reconnect")
	l.WaitCount(t, keys*perKey+slowN, time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("proxy accepted %d connections (a reconnect), cut %d ends; slow:1 started %d times, slow:14 %d", proxy.Accepted(), proxy.CutConns(), l.Started[ref{Key: "slow", Seq: 1}], l.Started[ref{Key: "slow", Seq: 14}])
	t.Logf("reorders %d, duplicates %d", len(l.Reorders), l.Duplicates)
	require.Empty(t, l.Reorders)
}

// TestKeyedSecondConsumerIsAStandby: two key-parallel consumers of one
// queue (two processes of a group): the queue is consumed exclusively,
// so the second gets nothing while the first runs (RabbitMQ would
// otherwise spread each key over both), and takes over once the first
// stops.
func TestKeyedSecondConsumerIsAStandby(t *testing.T) {
	t.Parallel()
	const group, keys, perKey = "standby", 4, 10
	topic := keyedTopic(t, group, keys, perKey)
	l := keyedtest.NewLedger()
	var byFirst, bySecond atomic.Int64
	handler := func(n *atomic.Int64) message.NoPublishHandlerFunc {
		return func(m *message.Message) error {
			r, _ := keyedtest.ParseRef(string(m.Payload))
			l.Start(r)
			l.End(r, true)
			n.Add(1)
			return nil
		}
	}
	stopFirst := runRouter(t, keyedTransport(t, transporttest.AMQPURL(), 2), topic, group, handler(&byFirst))
	l.WaitCount(t, 1, time.Minute) // the first one consumes
	runRouter(t, keyedTransport(t, transporttest.AMQPURL(), 2), topic, group, handler(&bySecond))
	l.WaitCount(t, keys*perKey, time.Minute)
	require.Zero(t, bySecond.Load(), "the standby got messages while the first consumer ran")

	stopFirst()
	pubTr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL()}, nil)
	require.NoError(t, err)
	defer pubTr.Close()
	for s := 0; s < 5; s++ {
		require.NoError(t, pubTr.Publisher().Publish(topic, keyedMessage(ref{Key: "after", Seq: s})))
	}
	l.WaitCount(t, keys*perKey+5, 2*time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("first %d, standby %d", byFirst.Load(), bySecond.Load())
	require.Equal(t, int64(5), bySecond.Load(), "the standby took over once the first stopped")
	require.Empty(t, l.Reorders)
}

// TestKeyedWaitsForAnotherSubscriber: a queue already consumed by
// watermill-amqp's subscriber (KeyParallelism 0, another process of the
// group) makes the key-parallel consumer's Subscribe wait, not fail, and
// not share the queue; it consumes once that subscriber stops.
func TestKeyedWaitsForAnotherSubscriber(t *testing.T) {
	t.Parallel()
	const group = "waits"
	topic := keyedTopic(t, group, 1, 1) // k0:0
	plain, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL()}, nil)
	require.NoError(t, err)
	defer plain.Close()
	psub, err := plain.Subscriber(group)
	require.NoError(t, err)
	pmsgs, err := psub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	select {
	case m := <-pmsgs:
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("watermill-amqp's subscriber got nothing")
	}

	l := keyedtest.NewLedger()
	runRouter(t, keyedTransport(t, transporttest.AMQPURL(), 2), topic, group, func(m *message.Message) error {
		r, _ := keyedtest.ParseRef(string(m.Payload))
		l.Start(r)
		l.End(r, true)
		return nil
	})
	require.NoError(t, plain.Publisher().Publish(topic, keyedMessage(ref{Key: "k1", Seq: 0})))
	select {
	case m := <-pmsgs:
		require.Equal(t, "k1:0", string(m.Payload), "the running subscriber keeps the queue")
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the running subscriber lost the queue")
	}
	require.Zero(t, l.Count(), "the key-parallel consumer shared the queue")

	require.NoError(t, psub.Close())
	require.NoError(t, plain.Publisher().Publish(topic, keyedMessage(ref{Key: "k2", Seq: 0})))
	l.WaitCount(t, 1, time.Minute)
	l.Mu.Lock()
	defer l.Mu.Unlock()
	require.True(t, l.Done[ref{Key: "k2", Seq: 0}], "the key-parallel consumer took over")
}
