package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// keyed returns n messages over keys ordering keys, dealt in turn; each
// payload is "key:seq", seq counting from 0 within its key.
func keyed(n, keys int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		k := fmt.Sprint("k", i%keys)
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(k+":"+strconv.Itoa(i/keys)))
		msgs[i].Metadata.Set(metadata.OrderingKey, k)
	}
	return msgs
}

// drain consumes want messages from queue (all it holds: the consumer
// acks automatically), within a minute, and returns their UUIDs and
// payloads in queue order.
func drain(t *testing.T, queue string, want int) (ids []string, payloads []string) {
	t.Helper()
	ch := rawChannel(t)
	require.NoError(t, ch.Qos(1000, 0, false))
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, ch.Close()) }()
	timeout := time.After(time.Minute)
	for len(ids) < want {
		select {
		case d := <-deliveries:
			id, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			ids = append(ids, id)
			payloads = append(payloads, string(d.Body))
		case <-timeout:
			t.Fatalf("got %d of %d messages from %s", len(ids), want, queue)
		}
	}
	return ids, payloads
}

func queueDepth(t *testing.T, queue string) int {
	t.Helper()
	q, err := rawChannel(t).QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages
}

// unreportedAreStored consumes everything in queue and checks that each
// message of msgs that be does not report failed is there; it returns how
// many messages the queue held.
func unreportedAreStored(t *testing.T, queue string, msgs []*message.Message, be *transport.BatchError) int {
	t.Helper()
	stored := queueDepth(t, queue)
	ids, _ := drain(t, queue, stored)
	inQueue := map[string]bool{}
	for _, id := range ids {
		inQueue[id] = true
	}
	for i, m := range msgs {
		if _, failed := be.Failed[i]; !failed {
			require.True(t, inQueue[m.UUID], "message %d (%s) was reported published but is not in the queue", i, m.UUID)
		}
	}
	return stored
}

// batchResult is what a PublishBatch running in the background sent on
// done, within 30 s of after (what the test did to end it).
func batchResult(t *testing.T, done <-chan error, after string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("PublishBatch did not return within 30s of %s", after)
		return nil
	}
}

func batchError(t *testing.T, err error) *transport.BatchError {
	t.Helper()
	var be *transport.BatchError
	require.ErrorAs(t, err, &be, "want a *transport.BatchError, got %v", err)
	return be
}

// The transport's wrapped publisher has PublishBatch too.
func TestTransportPublisherHasPublishBatch(t *testing.T) {
	t.Parallel()
	tr := transporttest.Open(t, transport.AMQP)
	_, ok := tr.Publisher().(transport.BatchPublisher)
	require.True(t, ok, "transport.Open's amqp publisher does not expose PublishBatch")
}

// A large batch is spread over several channels, all of it confirmed and
// stored, each ordering key in order; the channels go back to the pool.
func TestPublishBatchAllConfirmedInKeyOrder(t *testing.T) {
	t.Parallel()
	const pool, n, keys = 4, 3000, 40
	b := setup(t, amqp.Config{ChannelPoolSize: pool, DeclareGroups: sink}, sink...)
	bp := b.pub.(transport.BatchPublisher)
	msgs := keyed(n, keys)
	require.NoError(t, bp.PublishBatch(b.topic, msgs...))
	require.Equal(t, pool-1, amqp.BatchChannels(b.pub), "the batch was not spread over the free channels but one")
	require.Equal(t, pool, amqp.FreeChannels(b.pub))

	ids, payloads := drain(t, amqp.QueueName(b.topic, sink[0]), n)
	seen := map[string]bool{}
	for _, id := range ids {
		seen[id] = true
	}
	for _, m := range msgs {
		require.True(t, seen[m.UUID], "message %s is not in the queue", m.UUID)
	}
	next := map[string]int{}
	for _, p := range payloads {
		k, seq, _ := strings.Cut(p, ":")
		require.Equal(t, strconv.Itoa(next[k]), seq, "key %s out of order", k)
		next[k]++
	}
	require.Len(t, next, keys)

	// A small batch takes one channel; an empty one does nothing.
	require.NoError(t, bp.PublishBatch(b.topic, keyed(10, 3)...))
	require.Equal(t, 1, amqp.BatchChannels(b.pub))
	require.NoError(t, bp.PublishBatch(b.topic))
}

// A queue that takes only 5 messages makes RabbitMQ nack the rest of the
// batch: the BatchError names exactly the messages that are not in the
// queue, each with ErrNacked or, after the nacked one of its key, not sent
// (ErrNotSent).
func TestPublishBatchReportsExactlyTheNacked(t *testing.T) {
	t.Parallel()
	const pool, n, room = 3, 600, 5
	b := setup(t, amqp.Config{ChannelPoolSize: pool}, "small")
	bindQueue(t, b.topic, "small", amqp091.Table{"x-max-length": int32(room), "x-overflow": "reject-publish"})
	bp := b.pub.(transport.BatchPublisher)
	msgs := keyed(n, 10)
	be := batchError(t, bp.PublishBatch(b.topic, msgs...))
	require.Equal(t, pool-1, amqp.BatchChannels(b.pub))
	require.Len(t, be.Failed, n-room)
	var nacked int
	for i, err := range be.Failed {
		if errors.Is(err, amqp.ErrNacked) {
			nacked++
		} else {
			require.ErrorIs(t, err, amqp.ErrNotSent)
		}
		require.ErrorContains(t, err, msgs[i].UUID)
	}
	require.Positive(t, nacked, "nothing was nacked")
	ids, _ := drain(t, amqp.QueueName(b.topic, "small"), room)
	for _, id := range ids {
		for i, m := range msgs {
			if m.UUID == id {
				require.NotContains(t, be.Failed, i, "stored message %s reported failed", id)
			}
		}
	}
	require.Equal(t, pool, amqp.FreeChannels(b.pub))
}

// Unroutable messages are failures by default, named one by one, mixed
// with routable ones of another batch on the same channels; with
// AllowUnroutable they are not.
func TestPublishBatchUnroutable(t *testing.T) {
	t.Parallel()
	const pool = 2
	b := setup(t, amqp.Config{ChannelPoolSize: pool}, "bound")
	bp := b.pub.(transport.BatchPublisher)
	// Keys of one message each, all in flight at once: more returns than
	// one returns buffer per channel holds.
	msgs := keyed(400, 400)
	be := batchError(t, bp.PublishBatch(b.topic, msgs...))
	require.Len(t, be.Failed, len(msgs))
	for i, err := range be.Failed {
		require.ErrorIs(t, err, amqp.ErrUnroutable)
		require.ErrorContains(t, err, msgs[i].UUID)
		require.ErrorContains(t, err, `no queue is bound to exchange "`+b.topic+`"`)
	}
	// A returned message stops its key: the rest of it is not sent.
	msgs = keyed(70, 7)
	be = batchError(t, bp.PublishBatch(b.topic, msgs...))
	require.Len(t, be.Failed, len(msgs))
	for i, err := range be.Failed {
		if i < 7 {
			require.ErrorIs(t, err, amqp.ErrUnroutable, "message %d, its key's first", i)
		} else {
			require.ErrorIs(t, err, amqp.ErrNotSent, "message %d, after its key's first", i)
			require.ErrorContains(t, err, msgs[i%7].UUID, "names the message that failed before it")
		}
	}
	require.Equal(t, pool, amqp.FreeChannels(b.pub))

	// Half routable: one topic bound, one not, interleaved batch by
	// batch on the same channels; no return leaks into the other topic's.
	bindQueue(t, b.topic, "bound", nil)
	other := freshTopic(t)
	for range 3 {
		require.NoError(t, bp.PublishBatch(b.topic, keyed(300, 5)...), "a stale return leaked into a routable batch")
		be := batchError(t, bp.PublishBatch(other, keyed(300, 5)...))
		require.Len(t, be.Failed, 300)
	}
	require.Equal(t, 900, queueDepth(t, amqp.QueueName(b.topic, "bound")))

	plain := setup(t, amqp.Config{AllowUnroutable: true})
	require.NoError(t, plain.pub.(transport.BatchPublisher).PublishBatch(plain.topic, keyed(300, 5)...))

	// Without confirms nothing is waited for: the whole batch is written.
	fast := setup(t, amqp.Config{AllowUnroutable: true, NoConfirm: true, DeclareGroups: sink}, sink...)
	require.NoError(t, fast.pub.(transport.BatchPublisher).PublishBatch(fast.topic, keyed(300, 5)...))
	poll.Until(t, 20*time.Second, func() bool { return queueDepth(t, amqp.QueueName(fast.topic, sink[0])) == 300 },
		"the unconfirmed batch did not reach the queue")
}

// A connection cut in the middle of a batch: the BatchError names only
// messages the broker did not confirm (every other one is in the queue),
// each with ErrNotConnected or, after one of its key, ErrNotSent; no channel is lost from the pool, and the
// next batch, on the new connection, is confirmed in full.
func TestPublishBatchConnectionCut(t *testing.T) {
	t.Parallel()
	proxy, through := proxied(t)
	const pool, n = 3, 30000
	b := setup(t, amqp.Config{URL: through, ChannelPoolSize: pool, ConnectTimeout: 5 * time.Second, DeclareGroups: sink}, sink...)
	bp := b.pub.(transport.BatchPublisher)
	queue := amqp.QueueName(b.topic, sink[0])
	// Declares the queue and opens every channel of the pool, so that
	// during the batch the broker sends the client nothing but confirms
	// (and, rarely, an 8-byte heartbeat).
	require.NoError(t, bp.PublishBatch(b.topic, keyed(1000, 50)...))
	before := queueDepth(t, queue)
	received := proxy.ServerBytes()

	msgs := keyed(n, 50)
	done := make(chan error, 1)
	go func() { done <- bp.PublishBatch(b.topic, msgs...) }()
	// Cut once the broker has stored part of the batch and the client got
	// confirms for some of it: 8 basic.ack frames' worth (21 bytes each),
	// so that a heartbeat or a connection.blocked frame alone does not
	// pass for a confirm (one CI run cut after 21 bytes and found nothing
	// confirmed).
	poll.Until(t, 20*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("the batch ended (%v) before the cut: raise n", err)
		default:
		}
		return queueDepth(t, queue) >= before+2 && proxy.ServerBytes()-received >= 8*21
	}, "the batch stored nothing, or no confirm reached the client")
	proxy.Cut()
	require.Positive(t, proxy.CutConns(), "the cut closed no connection")
	be := batchError(t, batchResult(t, done, "the cut"))
	require.NotEmpty(t, be.Failed)
	require.Less(t, len(be.Failed), n, "nothing was confirmed before the cut: the test did not cut mid-batch")
	var lost int
	for _, e := range be.Failed {
		if errors.Is(e, amqp.ErrNotConnected) {
			lost++
		} else {
			require.ErrorIs(t, e, amqp.ErrNotSent)
		}
	}
	require.Positive(t, lost, "no message was reported lost with the connection")
	require.Equal(t, pool, amqp.FreeChannels(b.pub))

	stored := unreportedAreStored(t, queue, msgs, be)
	t.Logf("cut mid-batch: %d of %d unconfirmed, %d stored", len(be.Failed), n, stored)

	require.True(t, amqp.WaitConnected(b.pub, true, 20*time.Second), "the publisher did not reconnect")
	again := keyed(1000, 10)
	require.NoError(t, bp.PublishBatch(b.topic, again...))
	// The broker may still store messages of the cut batch that it had
	// read before the cut (reported failed: "it may still be stored"),
	// after the drain above: look for the new batch, not at the count.
	depth := queueDepth(t, queue)
	require.GreaterOrEqual(t, depth, len(again))
	ids, _ := drain(t, queue, depth)
	inQueue := map[string]bool{}
	for _, id := range ids {
		inQueue[id] = true
	}
	for i, m := range again {
		require.True(t, inQueue[m.UUID], "message %d of the batch after reconnecting (%s) is not in the queue", i, m.UUID)
	}
	require.Equal(t, pool, amqp.FreeChannels(b.pub))
}

// A batch whose context is done fails before sending anything.
func TestPublishBatchCancelledContext(t *testing.T) {
	t.Parallel()
	b := setup(t, amqp.Config{ChannelPoolSize: 1, DeclareGroups: sink}, sink...)
	bp := b.pub.(transport.BatchPublisher)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msgs := keyed(3, 1)
	for _, m := range msgs {
		m.SetContext(ctx)
	}
	err := bp.PublishBatch(b.topic, msgs...)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, errors.As(err, new(*transport.BatchError)), "nothing was sent: not a partial failure")
	require.Equal(t, 1, amqp.FreeChannels(b.pub))
	require.NoError(t, bp.PublishBatch(b.topic, keyed(2, 1)...))
	require.Equal(t, 2, queueDepth(t, amqp.QueueName(b.topic, sink[0])), "the cancelled batch was sent")
}

// Messages whose context ends while their confirms are awaited are
// reported (context.Canceled) instead of waited for, and the channel,
// closed under the pending confirms, is replaced without losing its slot.
// The broker's confirms are held at a proxy, so every message is stored
// and none is confirmed when the context ends (without the hold, a fast
// broker confirms a whole batch before the context is looked at).
func TestPublishBatchContextEndsWhileWaiting(t *testing.T) {
	t.Parallel()
	proxy, through := proxied(t)
	b := setup(t, amqp.Config{URL: through, ChannelPoolSize: 1, ConnectTimeout: 5 * time.Second, DeclareGroups: sink}, sink...)
	bp := b.pub.(transport.BatchPublisher)
	queue := amqp.QueueName(b.topic, sink[0])
	require.NoError(t, bp.PublishBatch(b.topic, keyed(1, 1)...)) // declares the queue

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 300
	msgs := keyed(n, n) // one message per key: all in flight at once
	for _, m := range msgs {
		m.SetContext(ctx)
	}
	proxy.Hold()
	defer proxy.Release()
	done := make(chan error, 1)
	go func() { done <- bp.PublishBatch(b.topic, msgs...) }()
	poll.Until(t, 20*time.Second, func() bool { return queueDepth(t, queue) == 1+n },
		"the broker did not store the batch")
	require.Positive(t, proxy.HeldReads(), "no confirm was held back")
	sent := proxy.ClientBytes()
	cancel()
	// Giving up closes the channel: the close goes out to the broker, and
	// waits for a reply the proxy holds; the cut ends that wait.
	poll.Until(t, 10*time.Second, func() bool { return proxy.ClientBytes() > sent },
		"the publisher did not close its channel when the context ended")
	proxy.Cut()
	be := batchError(t, batchResult(t, done, "the context ending"))
	require.Len(t, be.Failed, n, "every message was unconfirmed when the context ended")
	for i, err := range be.Failed {
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorContains(t, err, msgs[i].UUID)
	}
	require.Equal(t, 1, amqp.FreeChannels(b.pub))
	proxy.Release()
	// The publisher may not have noticed the cut yet when it is asked
	// (WaitConnected then answers for the old connection): a publish
	// refused as not connected sends nothing, so ask again until the new
	// connection takes it.
	var last error
	poll.Until(t, 20*time.Second, func() bool {
		last = bp.PublishBatch(b.topic, keyed(500, 5)...)
		if last != nil {
			require.ErrorIs(t, last, amqp.ErrNotConnected)
		}
		return last == nil
	}, "the publisher did not reconnect: %v", last)
	require.Equal(t, 1+n+500, queueDepth(t, queue))
}

// fillQueue publishes, confirmed, a message of size bytes straight to
// queue (through the default exchange): it takes that much of the room of
// a queue with x-max-length-bytes until a consumer takes it.
func fillQueue(t *testing.T, queue string, size int) {
	t.Helper()
	ch := rawChannel(t)
	require.NoError(t, ch.Confirm(false))
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", queue, true, false,
		amqp091.Publishing{Body: make([]byte, size), DeliveryMode: amqp091.Persistent, Headers: amqp091.Table{"filler": true}})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	acked, err := dc.WaitContext(ctx)
	require.NoError(t, err, "the filler was not confirmed")
	require.True(t, acked, "the broker refused the filler")
}

// When the broker refuses a message (a queue with x-overflow=reject-publish
// that the message would overfill), nothing after it with the same
// ordering key is sent: a retry of the refused one, then of the rest, then
// reaches a consumer that drops duplicates in order. The queue's room is
// taken by a filler so that each key's big first message is nacked while
// its small later ones would fit (as pipelining them did: they were stored
// ahead of their key's first message). Other keys are not held back.
func TestPublishBatchKeyStopsAtItsFirstNack(t *testing.T) {
	t.Parallel()
	const room, big, keys, perKey = 500, 1000, 6, 5
	b := setup(t, amqp.Config{ChannelPoolSize: 2}, "full")
	queue := amqp.QueueName(b.topic, "full")
	const limit = 20000
	bindQueue(t, b.topic, "full", amqp091.Table{"x-max-length-bytes": int32(limit), "x-overflow": "reject-publish"})
	fillQueue(t, queue, limit-room)

	// Keys k0..k5: seq 0 is too big for the room, the rest small; key
	// "free" has only small messages and fits whole (room for all the
	// small ones: 6*4+5 bodies of at most 8 bytes).
	var msgs []*message.Message
	add := func(k string, seq, size int) {
		body := []byte(k + ":" + strconv.Itoa(seq))
		if len(body) < size {
			body = append(body, strings.Repeat(" ", size-len(body))...)
		}
		m := message.NewMessage(watermill.NewUUID(), body)
		m.Metadata.Set(metadata.OrderingKey, k)
		msgs = append(msgs, m)
	}
	for seq := range perKey {
		for k := range keys {
			size := 0
			if seq == 0 {
				size = big
			}
			add(fmt.Sprint("k", k), seq, size)
		}
		add("free", seq, 0)
	}
	bp := b.pub.(transport.BatchPublisher)
	be := batchError(t, bp.PublishBatch(b.topic, msgs...))
	var nacked int
	for i, err := range be.Failed {
		k, _, _ := strings.Cut(string(msgs[i].Payload), ":")
		require.NotEqual(t, "free", k, "message %d of the key that fits failed: %v", i, err)
		if errors.Is(err, amqp.ErrNacked) {
			nacked++
			require.Len(t, msgs[i].Payload, big, "a small message was nacked: the room was smaller than planned")
		}
	}
	require.Equal(t, keys, nacked, "every key's first message is nacked (the fault happened), and nothing else: %v", be)
	require.Len(t, be.Failed, keys*perKey, "every message of a nacked key fails: after the nack, its later ones are not sent")

	// From the consumer's side: the queue holds the filler and key
	// "free", nothing of the nacked keys.
	depth := queueDepth(t, queue)
	_, payloads := drain(t, queue, depth)
	stored := map[string][]string{}
	for _, p := range payloads[1:] { // the filler first
		k, seq, _ := strings.Cut(strings.TrimRight(p, " "), ":")
		stored[k] = append(stored[k], seq)
	}
	require.Equal(t, map[string][]string{"free": {"0", "1", "2", "3", "4"}}, stored,
		"a message stored after its key's first message was nacked would reach consumers ahead of it")

	// As the outbox relay does: publish the failed ones again, in order;
	// the queue now has room. A consumer dropping duplicates applies each
	// key in order.
	var again []*message.Message
	for i, m := range msgs {
		if _, ok := be.Failed[i]; ok {
			again = append(again, m)
		}
	}
	require.NoError(t, bp.PublishBatch(b.topic, again...))
	ids, payloads := drain(t, queue, len(again))
	next := map[string]int{}
	seen := map[string]bool{}
	for j, p := range payloads {
		if seen[ids[j]] {
			continue
		}
		seen[ids[j]] = true
		k, seq, _ := strings.Cut(strings.TrimRight(p, " "), ":")
		require.Equal(t, strconv.Itoa(next[k]), seq, "key %s: first deliveries out of order: %v", k, payloads)
		next[k]++
	}
	require.Len(t, next, keys)
	require.Equal(t, 2, amqp.FreeChannels(b.pub))
}

// RabbitMQ closes the channel with 406 PRECONDITION_FAILED, naming the
// size it refused and its max_message_size, for a body over the limit:
// only a message over that limit is at fault (permanent); the others on
// the channel merely lost it. The broker's reason text is
// rabbit_channel.erl's, as RabbitMQ 3.8 to 4.x send it. (The shared broker's
// limit is global, so the tests do not lower it.)
func TestTooLargeReadsTheBrokersReason(t *testing.T) {
	t.Parallel()
	closed := &amqp091.Error{Code: amqp091.PreconditionFailed, Reason: "PRECONDITION_FAILED - message size 2001 is larger than configured max size 2000"}
	require.True(t, amqp.TooLarge(closed, 2001))
	require.False(t, amqp.TooLarge(closed, 10), "a small message on the same channel is not at fault")
	require.False(t, amqp.TooLarge(&amqp091.Error{Code: amqp091.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange"}, 1<<30))
	require.False(t, amqp.TooLarge(&amqp091.Error{Code: amqp091.NotFound, Reason: "message size 2001 is larger than configured max size 2000"}, 2001))
	require.False(t, amqp.TooLarge(nil, 1<<30))
}

// RabbitMQ answers 530 NOT_ALLOWED both for a vhost the user may not use
// (permanent: waiting cannot fix it) and for a vhost at its connection
// limit or restarting (transient: transport.Open waits for it).
func TestVhostRefusalsThatWaitingFixesAreNotPermanent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		reason    string
		permanent bool
	}{
		{"NOT_ALLOWED - access to vhost 'orders' refused for user 'app'", true},
		{"NOT_ALLOWED - connection refused: vhost 'orders' connection limit (10) is reached", false},
		{"NOT_ALLOWED - vhost orders is down", false},
	} {
		err := amqp.ConnectError("amqp://app:secret@127.0.0.1:5672/orders", "MILLWRIGHT_AMQP_URL", &amqp091.Error{Code: amqp091.NotAllowed, Reason: tc.reason})
		require.Equal(t, tc.permanent, failure.IsPermanent(err), "%s: %v", tc.reason, err)
		require.NotContains(t, err.Error(), "secret")
	}
}
