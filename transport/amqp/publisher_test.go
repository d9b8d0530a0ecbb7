package amqp_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// bundle is what a publisher test needs: an open transport and a fresh
// topic whose exchange and groups' queues are deleted at cleanup.
type bundle struct {
	tr    *amqp.Transport
	pub   message.Publisher
	topic string
}

func setup(t *testing.T, cfg amqp.Config, groups ...string) *bundle {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = transporttest.AMQPURL()
	}
	tr, err := amqp.Open(context.Background(), cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tr.Close()) })
	return &bundle{tr: tr, pub: tr.Publisher(), topic: freshTopic(t, groups...)}
}

// sink is a group whose queue tests declare so that their publishes are
// routable (an unroutable publish fails by default).
var sink = []string{"sink"}

// freshTopic names a topic no other test uses; its exchange and the
// queues of groups on it are deleted at cleanup.
func freshTopic(t *testing.T, groups ...string) string {
	topic := "mw_amqppub_" + watermill.NewShortUUID()
	t.Cleanup(func() {
		require.NoError(t, amqp.DeleteTopology(transporttest.AMQPURL(), []string{topic}, groups...))
	})
	return topic
}

func (b *bundle) publish() error {
	return b.pub.Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte("x")))
}

// rawChannel is a plain amqp091 channel on the test broker, for checking
// what the publisher put there.
func rawChannel(t *testing.T) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(transporttest.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}

// bindQueue binds the durable queue of group to topic's exchange, which
// it declares as the publisher does.
func bindQueue(t *testing.T, topic, group string, args amqp091.Table) {
	t.Helper()
	ch := rawChannel(t)
	require.NoError(t, ch.ExchangeDeclare(topic, "fanout", true, false, false, false, nil))
	q := amqp.QueueName(topic, group)
	_, err := ch.QueueDeclare(q, true, false, false, false, args)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q, "", topic, false, nil))
}

// proxied starts a faultproxy to the test broker and returns it with the
// broker's URL through it.
func proxied(t *testing.T) (*faultproxy.Proxy, string) {
	t.Helper()
	proxy, through, err := faultproxy.Through(transporttest.AMQPURL(), "5672")
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	return proxy, through
}

// waitGroup waits for wg at most d.
func waitGroup(t *testing.T, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s still running after %s", what, d)
	}
}

// The leak regression: watermill-amqp v2.1.3's pool lost a channel for
// every publish that failed while disconnected, and then blocked every
// publish. Here publishes during an outage fail promptly, more of them
// than the pool has channels, and afterwards the whole pool works.
func TestPublisherRecoversFromOutage(t *testing.T) {
	t.Parallel()
	proxy, through := proxied(t)
	const pool = 2
	// A publish that waited for a connection would take ConnectTimeout;
	// failing promptly is anything well under it (a loaded machine's
	// scheduling included).
	b := setup(t, amqp.Config{URL: through, ChannelPoolSize: pool, ConnectTimeout: 2 * time.Minute, DeclareGroups: sink}, sink...)
	require.NoError(t, b.publish())

	proxy.Outage(time.Hour) // ended by the Cut below
	require.Positive(t, proxy.CutConns(), "the outage cut no connection")
	require.True(t, amqp.WaitConnected(b.pub, false, 10*time.Second), "the publisher did not notice the cut")
	for range 3 * pool {
		start := time.Now()
		err := b.publish()
		require.ErrorIs(t, err, amqp.ErrNotConnected)
		require.ErrorContains(t, err, "is down")
		require.Less(t, time.Since(start), time.Minute, "a publish during the outage waited for a connection instead of failing")
	}
	require.Equal(t, pool, amqp.FreeChannels(b.pub))

	proxy.Cut() // accept again
	require.True(t, amqp.WaitConnected(b.pub, true, 20*time.Second), "the publisher did not reconnect")
	for i := range 50 {
		require.NoError(t, b.publish(), "publish %d after the reconnect", i)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4*pool*10)
	for range 4 * pool {
		wg.Go(func() {
			for range 10 {
				errs <- b.publish()
			}
		})
	}
	waitGroup(t, &wg, 30*time.Second, "concurrent publishes")
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, pool, amqp.FreeChannels(b.pub))
}

// Publishes in flight when the connection is cut return (an error or nil)
// instead of hanging, and publishing resumes on the new connection.
func TestPublisherCutMidFlight(t *testing.T) {
	t.Parallel()
	proxy, through := proxied(t)
	const pool = 2
	b := setup(t, amqp.Config{URL: through, ChannelPoolSize: pool, ConnectTimeout: 5 * time.Second, DeclareGroups: sink}, sink...)

	var (
		wg        sync.WaitGroup
		stop      = make(chan struct{})
		started   = make(chan struct{}, 8)
		cutDone   atomic.Bool
		afterCut  atomic.Int64 // successes begun after the cut
		enough    = make(chan struct{})
		enoughOne sync.Once
		slowest   atomic.Int64
		mu        sync.Mutex
		failures  []error
	)
	for range 8 {
		wg.Go(func() {
			first := true
			for {
				select {
				case <-stop:
					return
				default:
				}
				begun := cutDone.Load()
				t0 := time.Now()
				err := b.publish()
				for d := int64(time.Since(t0)); ; {
					if old := slowest.Load(); d <= old || slowest.CompareAndSwap(old, d) {
						break
					}
				}
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
					continue
				}
				if first {
					first = false
					started <- struct{}{}
				}
				if begun && afterCut.Add(1) == 200 {
					enoughOne.Do(func() { close(enough) })
				}
			}
		})
	}
	for range 8 {
		<-started
	}
	proxy.Cut()
	cutDone.Store(true)
	require.Positive(t, proxy.CutConns())
	select {
	case <-enough:
	case <-time.After(30 * time.Second):
		t.Fatalf("publishing did not resume after the cut (%d successes since)", afterCut.Load())
	}
	close(stop)
	waitGroup(t, &wg, 30*time.Second, "publishers")
	require.Less(t, time.Duration(slowest.Load()), 15*time.Second)
	for _, err := range failures {
		require.ErrorIs(t, err, amqp.ErrNotConnected)
	}
	t.Logf("%d publishes failed across the cut", len(failures))
	require.Equal(t, pool, amqp.FreeChannels(b.pub))
}

func ceMessage() *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"o-1"}`))
	cloudevent.Attributes{
		ID: "evt-" + msg.UUID, Source: "/orders-service", Type: "order.created.v1",
		Time:    time.Date(2026, 3, 4, 5, 6, 7, 890000000, time.UTC),
		Subject: "order-1", DataContentType: "application/json; charset=utf-8",
	}.Apply(msg)
	msg.Metadata.Set("x_custom", "kept")
	return msg
}

// A confirmed publish is in the queue a DeclareGroups group declared, in
// the wire format of earlier versions, on watermill-amqp's exchange.
func TestPublishWireFormat(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{DeclareGroups: []string{"wire"}}, "wire")
	sent := ceMessage()
	require.NoError(t, b.pub.Publish(b.topic, sent))

	ch := rawChannel(t)
	d, ok, err := ch.Get(amqp.QueueName(b.topic, "wire"), true)
	require.NoError(t, err)
	require.True(t, ok, "the confirmed message is not in the declared group's queue")
	require.Equal(t, b.topic, d.Exchange)
	require.Equal(t, []byte(sent.Payload), d.Body)
	require.Equal(t, amqp091.Persistent, d.DeliveryMode)
	require.Equal(t, sent.UUID, d.Headers[wamqp.DefaultMessageUUIDHeaderKey])
	require.Equal(t, "application/json; charset=utf-8", d.ContentType)
	require.Equal(t, sent.Metadata.Get(metadata.EventID), d.Headers["cloudEvents:id"])
	for _, a := range []string{"source", "type", "specversion", "time", "subject"} {
		require.Equal(t, sent.Metadata.Get("ce_"+a), d.Headers["cloudEvents:"+a], a)
	}
	require.Equal(t, "kept", d.Headers["x_custom"])
	for k := range d.Headers {
		require.NotRegexp(t, `^ce_`, k, "a ce_ key leaked onto AMQP")
	}
	got, err := amqp.Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, sent.Metadata, got.Metadata)

	// The exchange is a durable fanout: redeclaring it so succeeds, any
	// other way is refused (406, which closes the channel).
	require.NoError(t, ch.ExchangeDeclare(b.topic, "fanout", true, false, false, false, nil))
	require.Error(t, ch.ExchangeDeclare(b.topic, "direct", true, false, false, false, nil))
}

// A nack is an error, and the channel that got it stays usable.
func TestPublishNackIsError(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{ChannelPoolSize: 1}, "full")
	// A queue that refuses every message: RabbitMQ nacks the publish.
	bindQueue(t, b.topic, "full", amqp091.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"})
	err := b.publish()
	require.ErrorIs(t, err, amqp.ErrNacked)
	require.ErrorContains(t, err, b.topic)

	other := freshTopic(t, sink...)
	bindQueue(t, other, sink[0], nil)
	require.NoError(t, b.pub.Publish(other, message.NewMessage(watermill.NewUUID(), nil)))
	require.Equal(t, 1, amqp.FreeChannels(b.pub))
}

// A channel closed by the broker before the confirm (here: the exchange
// was deleted under the publisher) is an error; the next publish opens a
// new channel and declares the exchange again.
func TestPublishChannelClosedBeforeConfirm(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{ChannelPoolSize: 1, DeclareGroups: sink}, sink...)
	require.NoError(t, b.publish())
	require.NoError(t, amqp.DeleteTopology(transporttest.AMQPURL(), []string{b.topic}))
	err := b.publish()
	require.ErrorContains(t, err, "channel closed before the broker confirmed it")
	require.ErrorContains(t, err, "404")
	require.NotErrorIs(t, err, amqp.ErrNotConnected)
	require.NoError(t, b.publish())
}

// By default a message no queue would receive is a failed publish.
// It relies on RabbitMQ sending basic.return before basic.ack: repeated,
// so a return that came late would show.
func TestPublishUnroutableFails(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{ChannelPoolSize: 1}, "bound")
	for range 20 {
		err := b.publish()
		require.ErrorIs(t, err, amqp.ErrUnroutable)
		require.ErrorContains(t, err, `no queue is bound to exchange "`+b.topic+`": nothing would receive the message`)
	}
	msgs := []*message.Message{
		message.NewMessage(watermill.NewUUID(), nil),
		message.NewMessage(watermill.NewUUID(), nil),
		message.NewMessage(watermill.NewUUID(), nil),
	}
	err := b.pub.Publish(b.topic, msgs...)
	require.ErrorIs(t, err, amqp.ErrUnroutable)
	require.ErrorContains(t, err, "3 of 3 messages")
	for _, m := range msgs {
		require.ErrorContains(t, err, m.UUID)
	}

	bindQueue(t, b.topic, "bound", nil)
	require.NoError(t, b.publish(), "a stale return leaked into the next publish")
	batch := make([]*message.Message, 150) // more messages than the returns buffer holds
	for i := range batch {
		batch[i] = message.NewMessage(watermill.NewUUID(), nil)
	}
	require.NoError(t, b.pub.Publish(b.topic, batch...))
	q, err := rawChannel(t).QueueDeclarePassive(amqp.QueueName(b.topic, "bound"), true, false, false, false, nil)
	require.NoError(t, err)
	require.Equal(t, 151, q.Messages)

	// With AllowUnroutable the fanout exchange drops it, as plain AMQP does.
	plain := setup(t, amqp.Config{AllowUnroutable: true})
	require.NoError(t, plain.publish())
	fast := setup(t, amqp.Config{AllowUnroutable: true, NoConfirm: true})
	require.NoError(t, fast.publish())

	_, err = amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), NoConfirm: true}, nil)
	require.ErrorContains(t, err, "NoConfirm needs AllowUnroutable")
}

// Close while publishing neither panics nor races; publishes after it
// fail with ErrClosed; a second Close is a no-op.
func TestPublisherCloseWhilePublishing(t *testing.T) {
	t.Parallel()
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), ChannelPoolSize: 2}, nil)
	require.NoError(t, err)
	topic := freshTopic(t)
	pub := tr.Publisher()

	var wg sync.WaitGroup
	running := make(chan struct{}, 16)
	for range 16 {
		wg.Go(func() {
			signalled := false
			for {
				err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil))
				if !signalled {
					signalled = true
					running <- struct{}{}
				}
				if errors.Is(err, amqp.ErrClosed) {
					return
				}
			}
		})
	}
	for range 16 {
		<-running
	}
	var closers sync.WaitGroup
	closeErrs := make(chan error, 2)
	for range 2 {
		closers.Go(func() { closeErrs <- tr.Close() })
	}
	waitGroup(t, &closers, 30*time.Second, "Close")
	waitGroup(t, &wg, 30*time.Second, "publishers after Close")
	close(closeErrs)
	for err := range closeErrs {
		require.NoError(t, err)
	}
	require.NoError(t, tr.Close())
	require.ErrorIs(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), amqp.ErrClosed)
	require.True(t, amqp.WaitConnected(pub, false, time.Second))

	// Closing while disconnected and reconnecting is as quiet.
	proxy, through := proxied(t)
	tr2, err := amqp.Open(context.Background(), amqp.Config{URL: through}, nil)
	require.NoError(t, err)
	proxy.Outage(time.Hour)
	require.True(t, amqp.WaitConnected(tr2.Publisher(), false, 10*time.Second))
	require.NoError(t, tr2.Close())
	require.NoError(t, tr2.Close())
}

// A publish whose context is already done is not attempted.
func TestPublishCancelledContext(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{ChannelPoolSize: 1, DeclareGroups: sink}, sink...)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.SetContext(ctx)
	require.ErrorIs(t, b.pub.Publish(b.topic, msg), context.Canceled)
	require.NoError(t, b.publish())
	require.Equal(t, 1, amqp.FreeChannels(b.pub))
}

// Publish with several messages keeps the order of each ordering key
// under partial failure too: a key's message the broker refuses (a full
// queue with x-overflow=reject-publish) stops its key, so no later one of
// it is stored ahead of it for when the caller publishes the call again;
// other keys go on. As the outbox relay calls it for a wrapped publisher
// (one that hides PublishBatch).
func TestPublishKeyStopsAtItsFirstNack(t *testing.T) {
	t.Parallel()
	const limit, room = 20000, 500
	b := setup(t, amqp.Config{ChannelPoolSize: 1}, "full")
	queue := amqp.QueueName(b.topic, "full")
	bindQueue(t, b.topic, "full", amqp091.Table{"x-max-length-bytes": int32(limit), "x-overflow": "reject-publish"})
	fillQueue(t, queue, limit-room)
	msg := func(key, body string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(body))
		m.Metadata.Set(metadata.OrderingKey, key)
		return m
	}
	msgs := []*message.Message{
		msg("k", "k:0"+strings.Repeat(" ", 2*room)), // refused: larger than the room
		msg("o", "o:0"),
		msg("k", "k:1"),
		msg("o", "o:1"),
		msg("k", "k:2"),
	}
	err := b.pub.Publish(b.topic, msgs...)
	require.ErrorIs(t, err, amqp.ErrNacked, "the broker did not refuse the big message: the fault did not happen")
	_, payloads := drain(t, queue, queueDepth(t, queue))
	require.Equal(t, []string{"o:0", "o:1"}, payloads[1:], "the queue (after the filler) holds a later message of the refused one's key")
	require.ErrorIs(t, err, amqp.ErrNotSent)
	require.ErrorContains(t, err, "3 of 5 messages")
}

// confirmsHeld opens a publisher through a proxy, publishes once (the
// channel is open and the exchange declared), and then holds everything
// the broker sends until the test ends: a broker that stopped answering.
func confirmsHeld(t *testing.T) (*bundle, *faultproxy.Proxy) {
	t.Helper()
	proxy, through := proxied(t)
	b := setup(t, amqp.Config{URL: through, ChannelPoolSize: 1, ConnectTimeout: 5 * time.Second, DeclareGroups: sink}, sink...)
	require.NoError(t, b.publish())
	proxy.Hold()
	t.Cleanup(proxy.Release)
	return b, proxy
}

// A broker that stops answering (a memory alarm, a hung connection) holds
// the confirm; the publish ends at its message's deadline all the same,
// and does not wait for the close-ok of the channel it abandons (amqp091's
// Channel.Close waits for it with no bound: before, this publish hung
// until the connection died).
func TestPublishEndsAtItsDeadlineWhenConfirmsAreHeld(t *testing.T) {
	t.Parallel()
	b, proxy := confirmsHeld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	msg.SetContext(ctx)
	done := make(chan error, 1)
	go func() { done <- b.pub.Publish(b.topic, msg) }()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(15 * time.Second):
		t.Fatalf("publish still waiting 15s after its 500ms deadline (held reads %d)", proxy.HeldReads())
	}
	require.Positive(t, proxy.HeldReads(), "the broker's confirm was not held")
}

// Two messages in flight, confirms held: the first's context ends, the
// channel is given up on, and the second (whose context has no deadline)
// is reported with it instead of waiting for a confirm that the closed
// channel will never settle against a broker that does not answer.
func TestPublishBatchGivesUpOnTheWholeChannelWhenConfirmsAreHeld(t *testing.T) {
	t.Parallel()
	b, proxy := confirmsHeld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	first := message.NewMessage(watermill.NewUUID(), []byte("x"))
	first.Metadata.Set(metadata.OrderingKey, "a")
	first.SetContext(ctx)
	second := message.NewMessage(watermill.NewUUID(), []byte("y")) // no deadline
	second.Metadata.Set(metadata.OrderingKey, "b")
	done := make(chan error, 1)
	go func() { done <- b.pub.(transport.BatchPublisher).PublishBatch(b.topic, first, second) }()
	select {
	case err := <-done:
		var be *transport.BatchError
		require.ErrorAs(t, err, &be)
		require.Len(t, be.Failed, 2, "%v", err)
	case <-time.After(15 * time.Second):
		t.Fatalf("PublishBatch still waiting 15s after its first message's 500ms deadline (held reads %d)", proxy.HeldReads())
	}
}
