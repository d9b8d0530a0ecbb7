package amqp

import (
	"fmt"
	"sync"
	"sync/atomic"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// minPerLane is the fewest messages a batch gives each channel it uses: a
// smaller batch pipelines faster on one channel than it would pay for
// taking (and on first use opening) more.
const minPerLane = 128

var _ transport.BatchPublisher = (*publisher)(nil)

// batchStats is what tests read of the last PublishBatch.
type batchStats struct {
	lastLanes atomic.Int64 // channels the last PublishBatch used
}

// PublishBatch publishes msgs to topic's exchange over one or more pooled
// confirm channels without waiting between messages (deferred confirms),
// then waits once for every confirm. It returns nil when the broker
// confirmed all of them, and a *transport.BatchError naming exactly the
// messages that were nacked, returned as unroutable (unless
// AllowUnroutable), or left unconfirmed because their channel or the
// connection was lost or their context was done first. Any other error
// (closed publisher, no free channel within ConnectTimeout, msgs[0]'s
// context done before starting) means nothing was sent.
//
// Order: all messages with one metadata.OrderingKey go on one channel, in
// the order given, and RabbitMQ keeps a channel's publish order in each
// queue. Messages without a key are spread over the channels. Because the
// messages are pipelined, a failed message does not hold back the later
// ones of its key: when one fails (a nack, for example), later ones may be
// confirmed, and a retry of the failed one then arrives after them. The
// outbox relay keeps the failed row and publishes it again later.
//
// The first channel is waited for (up to ConnectTimeout, or msgs[0]'s
// context); a batch of at least 2×128 messages also takes, without
// waiting, up to one free channel per 128 messages, leaving at least one of
// the pool for concurrent Publish calls. Every channel goes back to the
// pool when PublishBatch returns. Waits for confirms end when the
// message's context is done or its channel closes (a lost connection
// closes it within the heartbeat, 10 s).
func (p *publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	if !p.enter() {
		return fmt.Errorf("amqp: publishing to %q: %w", topic, ErrClosed)
	}
	defer p.inflight.Done()

	failed := map[int]error{}
	pubs := make([]amqp091.Publishing, len(msgs))
	badKeys := map[string]string{} // ordering key -> UUID of its unmarshalable message
	send := make([]int, 0, len(msgs))
	for i, msg := range msgs {
		key := msg.Metadata.Get(metadata.OrderingKey)
		if bad, ok := badKeys[key]; ok && key != "" {
			failed[i] = fmt.Errorf("amqp: message %s to exchange %q not sent: message %s before it with ordering key %q could not be marshaled", msg.UUID, topic, bad, key)
			continue
		}
		pub, err := Marshaler{}.Marshal(msg)
		if err != nil {
			failed[i] = fmt.Errorf("amqp: marshaling message %s for %q: %w", msg.UUID, topic, err)
			badKeys[key] = msg.UUID
			continue
		}
		pubs[i] = pub
		send = append(send, i)
	}
	if len(send) == 0 {
		return &transport.BatchError{Failed: failed}
	}

	first, err := p.acquire(msgs[send[0]].Context(), topic)
	if err != nil {
		return err
	}
	slots := []*slot{first}
	defer func() {
		for _, s := range slots {
			p.slots <- s // never blocks: one place per slot
		}
	}()
	want := min(len(send)/minPerLane, max(cap(p.slots)-1, 1))
more:
	for len(slots) < want {
		select {
		case s := <-p.slots:
			slots = append(slots, s)
		default:
			break more
		}
	}

	lanes := assignLanes(msgs, send, len(slots))
	p.lastLanes.Store(int64(len(lanes)))
	results := make([]map[int]error, len(lanes))
	var wg sync.WaitGroup
	for l, lane := range lanes {
		wg.Go(func() { results[l] = p.sendLane(slots[l], topic, msgs, pubs, lane) })
	}
	wg.Wait()
	for _, r := range results {
		for i, err := range r {
			failed[i] = err
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &transport.BatchError{Failed: failed}
}

// assignLanes splits the indices in send over n lanes: each ordering key
// to one lane (keys dealt in turn as first seen, so lanes get about as
// many keys each), each message without a key to the next lane. Every
// lane keeps send's order.
func assignLanes(msgs []*message.Message, send []int, n int) [][]int {
	lanes := make([][]int, n)
	if n == 1 {
		lanes[0] = send
		return lanes
	}
	laneOf := map[string]int{}
	next := 0
	for _, i := range send {
		key := msgs[i].Metadata.Get(metadata.OrderingKey)
		l, ok := laneOf[key]
		if !ok || key == "" {
			l = next
			next = (next + 1) % n
			if key != "" {
				laneOf[key] = l
			}
		}
		lanes[l] = append(lanes[l], i)
	}
	return lanes
}

// sendLane publishes the messages at idx on s, waits for their confirms
// and returns the failed ones by index. The channel is discarded (the slot
// stays) whenever it is left in doubt.
func (p *publisher) sendLane(s *slot, topic string, msgs []*message.Message, pubs []amqp091.Publishing, idx []int) map[int]error {
	failed := map[int]error{}
	failFrom := func(from int, why string, err error) {
		for _, i := range idx[from:] {
			failed[i] = fmt.Errorf("amqp: message %s to exchange %q %s: %w", msgs[i].UUID, topic, why, err)
		}
	}
	conn, err := p.prepare(s, topic)
	if err != nil {
		failFrom(0, "not sent", err)
		return failed
	}
	stopReturns := collectReturns(s.returns)

	confirms := make([]*amqp091.DeferredConfirmation, 0, len(idx))
	for _, i := range idx {
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(msgs[i].Context(), topic, "", !p.cfg.AllowUnroutable, false, pubs[i])
		if err != nil {
			failFrom(len(confirms), "not sent", p.lost(conn, fmt.Sprintf("publishing message %s to exchange %q", msgs[i].UUID, topic), err))
			// Settle the confirms of those sent: closing the channel
			// fails the ones the broker has not confirmed yet.
			s.discard()
			break
		}
		confirms = append(confirms, dc)
	}
	p.awaitConfirms(conn, s, topic, msgs, idx[:len(confirms)], confirms, failed)
	markReturned(failed, msgs, idx, stopReturns())
	return failed
}

// collectReturns gathers what the broker returns on returns (nil: none)
// until the returned func is called, which gives them in the order sent.
// Gathering while publishing keeps returns' buffer from filling: amqp091
// delivers a return with a blocking send from the connection's reader.
func collectReturns(returns <-chan amqp091.Return) func() []amqp091.Return {
	if returns == nil {
		return func() []amqp091.Return { return nil }
	}
	var got []amqp091.Return
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for stopped := false; ; {
			var r amqp091.Return
			ok := false
			if stopped {
				// Every return came before its message's confirm, all of
				// which are in: what is left is buffered.
				select {
				case r, ok = <-returns:
				default:
				}
			} else {
				select {
				case r, ok = <-returns:
				case <-stop:
					stopped = true
					continue
				}
			}
			if !ok {
				return
			}
			got = append(got, r)
		}
	}()
	return func() []amqp091.Return {
		close(stop)
		<-done
		return got
	}
}

// awaitConfirms waits for the confirm of each message at idx (confirms,
// in the same order) and records in failed those not acked. A message's
// context ending first closes the channel, failing the rest at once.
func (p *publisher) awaitConfirms(conn *amqp091.Connection, s *slot, topic string, msgs []*message.Message, idx []int, confirms []*amqp091.DeferredConfirmation, failed map[int]error) {
	var gaveUp error // why the channel was closed under pending confirms, if by a context
	for n, dc := range confirms {
		i := idx[n]
		msg := msgs[i]
		if dc == nil { // NoConfirm: written is all there is to know
			continue
		}
		select {
		case <-dc.Done():
		case <-msg.Context().Done():
			select {
			case <-dc.Done(): // settled after all: judged below
			default:
				// Confirms are still owed on this channel: it cannot go
				// back to the pool. Closing it settles every pending
				// confirm (as not acked) at once.
				s.discard()
				if gaveUp == nil {
					gaveUp = fmt.Errorf("the context of message %s was done first: %w", msg.UUID, msg.Context().Err())
				}
			}
		}
		switch {
		case dc.Acked():
		case gaveUp != nil:
			failed[i] = fmt.Errorf("amqp: message %s to exchange %q: gave up waiting for the broker's confirm; it may still be stored: %w", msg.UUID, topic, gaveUp)
		case s.ch == nil || s.ch.IsClosed():
			failed[i] = p.lost(conn, fmt.Sprintf("message %s to exchange %q: channel closed before the broker confirmed it; it may still be stored", msg.UUID, topic), reasonErr(p.channelGone(s, topic)))
		default:
			failed[i] = fmt.Errorf("amqp: message %s to exchange %q: %w", msg.UUID, topic, ErrNacked)
		}
	}
}

// channelGone is why the broker closed s's channel, if it said (nil once
// the channel is discarded), forgetting topic's exchange if it was deleted.
func (p *publisher) channelGone(s *slot, topic string) *amqp091.Error {
	if s.ch == nil {
		return nil
	}
	why := s.closeReason()
	if why != nil && why.Code == amqp091.NotFound {
		p.forget(topic) // the exchange was deleted: declare it again
	}
	return why
}

// markReturned records in failed the messages at idx the broker returned.
func markReturned(failed map[int]error, msgs []*message.Message, idx []int, returned []amqp091.Return) {
	if len(returned) == 0 {
		return
	}
	pos := make(map[string][]int, len(idx)) // UUID -> its positions, for duplicates
	for _, i := range idx {
		pos[msgs[i].UUID] = append(pos[msgs[i].UUID], i)
	}
	for _, r := range returned {
		id, _ := r.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		at := pos[id]
		if len(at) == 0 {
			continue // not this batch's (cannot happen: returns precede confirms)
		}
		pos[id] = at[1:]
		failed[at[0]] = unroutableErr(id, r)
	}
}
