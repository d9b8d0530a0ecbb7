package amqp

import (
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/failure"
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
// confirm channels with deferred confirms: the messages of different
// ordering keys (and every message without a key) are in flight together,
// and within one key each message is sent once the broker has confirmed
// the one before it. It returns nil when the broker confirmed all of
// them, and a *transport.BatchError naming exactly the messages that were
// nacked, returned as unroutable (unless AllowUnroutable), left
// unconfirmed because their channel or the connection was lost or their
// context was done first, or not sent (ErrNotSent) because one before
// them with their key failed. Any other error (closed publisher, no free
// channel within ConnectTimeout, msgs[0]'s context done before starting)
// means nothing was sent.
//
// Order: all messages with one metadata.OrderingKey go on one channel, in
// the order given, and RabbitMQ keeps a channel's publish order in each
// queue. A key stops at its first failure: the broker never stores a
// message of a key after one it refused, so when the caller (the outbox
// relay) publishes the failed one and the rest again, a consumer that
// drops duplicates still applies the key in order. The price is one
// confirm round trip per message of a key: a batch takes as many round
// trips as its longest key has messages. Messages without a key are
// spread over the channels and not held back by anything.
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

// sendLane publishes the messages at idx on s and returns the failed ones
// by index. Within one ordering key it sends a message only once the
// broker has confirmed the one before it, and a key stops at its first
// failure (nack, return, loss, context): the rest of it is reported not
// sent. Pipelining the whole key instead let the broker refuse a message
// and store the next ones, which then reached consumers first, and the
// retry of the refused one came after them: a consumer dropping
// duplicates applied the key out of order. The keys of the lane (and
// every message without a key) are in flight together, one message per
// key at a time. The channel is discarded (the slot stays) whenever it is
// left in doubt; the lane then sends nothing more.
func (p *publisher) sendLane(s *slot, topic string, msgs []*message.Message, pubs []amqp091.Publishing, idx []int) map[int]error {
	conn, err := p.prepare(s, topic)
	if err != nil {
		failed := map[int]error{}
		for _, i := range idx {
			failed[i] = fmt.Errorf("amqp: message %s to exchange %q %w: %w", msgs[i].UUID, topic, ErrNotSent, err)
		}
		return failed
	}
	return p.sendPrepared(conn, s, topic, msgs, pubs, idx)
}

// sendPrepared is sendLane on a channel prepare has readied on conn.
func (p *publisher) sendPrepared(conn *amqp091.Connection, s *slot, topic string, msgs []*message.Message, pubs []amqp091.Publishing, idx []int) map[int]error {
	failed := map[int]error{}
	if p.cfg.NoConfirm {
		p.sendUnconfirmed(conn, s, topic, msgs, pubs, idx, failed)
		return failed
	}
	returns := collectReturns(s.returns)
	defer returns.stop()

	chains := chainsOf(msgs, idx)
	type sent struct {
		chain, at int // chains[chain][at] is the message
		dc        *amqp091.DeferredConfirmation
	}
	var flight []sent // in publish order
	var halt error    // why the lane sends nothing more, once set
	// stopChain reports chain c from position from on as not sent, why
	// (wrapped when it is an error).
	stopChain := func(c, from int, why any) {
		for _, i := range chains[c][from:] {
			if err, ok := why.(error); ok {
				failed[i] = fmt.Errorf("amqp: message %s to exchange %q %w: %w", msgs[i].UUID, topic, ErrNotSent, err)
			} else {
				failed[i] = fmt.Errorf("amqp: message %s to exchange %q %w: %s", msgs[i].UUID, topic, ErrNotSent, why)
			}
		}
	}
	// publish sends chains[c][at], or reports it and the rest of its
	// chain not sent.
	publish := func(c, at int) {
		if halt != nil {
			stopChain(c, at, halt)
			return
		}
		i := chains[c][at]
		if err := msgs[i].Context().Err(); err != nil {
			stopChain(c, at, fmt.Errorf("its context is done: %w", err))
			return
		}
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(msgs[i].Context(), topic, "", !p.cfg.AllowUnroutable, false, pubs[i])
		if err != nil {
			halt = p.lost(conn, fmt.Sprintf("publishing message %s to exchange %q", msgs[i].UUID, topic), err)
			// Closing the channel settles the confirms still owed on it.
			s.discard()
			failed[i] = halt // a write that failed may still have gone out whole
			stopChain(c, at+1, halt)
			return
		}
		flight = append(flight, sent{chain: c, at: at, dc: dc})
	}
	for c := range chains {
		publish(c, 0)
	}
	var gaveUp error                 // why the channel was closed under pending confirms, if by a context
	abandoned := make(chan struct{}) // closed with gaveUp: the confirms still owed will not come
	for len(flight) > 0 {
		f := flight[0]
		flight = flight[1:]
		i := chains[f.chain][f.at]
		msg := msgs[i]
		select {
		case <-f.dc.Done():
		case <-abandoned:
			// The channel was closed aside (it waits for a close-ok a
			// hung broker never sends): judged below, as given up on.
		case <-msg.Context().Done():
			select {
			case <-f.dc.Done(): // settled after all: judged below
			default:
				// Confirms are still owed on this channel: it cannot go
				// back to the pool. Closing it settles every pending
				// confirm (as not acked) at once.
				s.discard()
				if gaveUp == nil {
					gaveUp = fmt.Errorf("the context of message %s was done first: %w", msg.UUID, msg.Context().Err())
					halt = fmt.Errorf("gave up on the channel: %w", gaveUp)
					close(abandoned)
				}
			}
		}
		channelLost, err := p.confirmed(conn, s, topic, msg, f.dc, returns, gaveUp)
		if channelLost && halt == nil {
			halt = err
		}
		next := f.at + 1
		switch {
		case err != nil:
			failed[i] = err
			stopChain(f.chain, next, fmt.Sprintf("message %s before it with ordering key %q failed; publish it again after that one", msg.UUID, msg.Metadata.Get(metadata.OrderingKey)))
		case next < len(chains[f.chain]):
			publish(f.chain, next)
		}
	}
	return failed
}

// confirmed judges msg once its confirm dc settled (or was given up on,
// gaveUp set): nil when the broker acked it and did not return it, else
// why not. channelLost is true when the channel closed under it: the lane
// sends nothing more on it.
func (p *publisher) confirmed(conn *amqp091.Connection, s *slot, topic string, msg *message.Message, dc *amqp091.DeferredConfirmation, returns *returnCollector, gaveUp error) (channelLost bool, err error) {
	switch {
	case dc.Acked():
		// The broker returns an unroutable message before acking it.
		if r, ok := returns.of(msg.UUID); ok {
			return false, unroutableErr(msg.UUID, r)
		}
		return false, nil
	case gaveUp != nil:
		return false, fmt.Errorf("amqp: message %s to exchange %q: gave up waiting for the broker's confirm; it may still be stored: %w", msg.UUID, topic, gaveUp)
	case s.ch == nil || s.ch.IsClosed():
		why := p.channelGone(s, topic)
		err = p.lost(conn, fmt.Sprintf("message %s to exchange %q: channel closed before the broker confirmed it; it may still be stored", msg.UUID, topic), reasonErr(why))
		if tooLarge(why, len(msg.Payload)) {
			// No retry can make the broker take it; the other messages
			// on the channel only lost their channel.
			err = failure.Permanent(fmt.Errorf("amqp: message %s to exchange %q: %w: its body of %d bytes is over the broker's max_message_size (%s): store large data elsewhere and send a reference",
				msg.UUID, topic, transport.ErrMessageTooLarge, len(msg.Payload), why.Reason))
		}
		return true, err
	default:
		return false, fmt.Errorf("amqp: message %s to exchange %q: %w", msg.UUID, topic, ErrNacked)
	}
}

// chainsOf splits the indices in idx into chains that are sent one
// message at a time: one per ordering key, in order, and one per message
// without a key (or per UUID among those, so that the broker's return of
// one copy cannot be taken for another's).
func chainsOf(msgs []*message.Message, idx []int) [][]int {
	var chains [][]int
	of := map[string]int{}
	for _, i := range idx {
		key := "k" + msgs[i].Metadata.Get(metadata.OrderingKey)
		if key == "k" {
			key = "u" + msgs[i].UUID
		}
		c, ok := of[key]
		if !ok {
			c = len(chains)
			of[key] = c
			chains = append(chains, nil)
		}
		chains[c] = append(chains[c], i)
	}
	return chains
}

// sendUnconfirmed publishes the messages at idx on s without confirms
// (Config.NoConfirm): written is all there is to know, so a write error
// fails the message and everything after it.
func (p *publisher) sendUnconfirmed(conn *amqp091.Connection, s *slot, topic string, msgs []*message.Message, pubs []amqp091.Publishing, idx []int, failed map[int]error) {
	for n, i := range idx {
		_, err := s.ch.PublishWithDeferredConfirmWithContext(msgs[i].Context(), topic, "", !p.cfg.AllowUnroutable, false, pubs[i])
		if err == nil {
			continue
		}
		err = p.lost(conn, fmt.Sprintf("publishing message %s to exchange %q", msgs[i].UUID, topic), err)
		s.discard()
		failed[i] = err
		for _, j := range idx[n+1:] {
			failed[j] = fmt.Errorf("amqp: message %s to exchange %q %w: %w", msgs[j].UUID, topic, ErrNotSent, err)
		}
		return
	}
}

// returnCollector gathers what the broker returns on a channel while a
// lane publishes on it. Gathering all the time keeps the returns buffer
// from filling: amqp091 delivers a return with a blocking send from the
// connection's reader, so a full buffer would stall the connection, and
// with it the confirms the lane waits for.
type returnCollector struct {
	returns <-chan amqp091.Return
	sync    chan chan struct{} // a request to take in what is buffered
	done    chan struct{}

	mu  sync.Mutex
	got map[string][]amqp091.Return // by message UUID, in the order returned
}

// collectReturns starts gathering from returns (nil: none are expected).
func collectReturns(returns <-chan amqp091.Return) *returnCollector {
	rc := &returnCollector{returns: returns, sync: make(chan chan struct{}), done: make(chan struct{}), got: map[string][]amqp091.Return{}}
	if returns == nil {
		close(rc.done)
		return rc
	}
	go rc.run()
	return rc
}

func (rc *returnCollector) run() {
	defer close(rc.done)
	for {
		select {
		case r, ok := <-rc.returns:
			if !ok {
				return
			}
			rc.add(r)
		case reply, ok := <-rc.sync:
			if !ok {
				// Stopped: take in what is left, so that no return of
				// this lane stays buffered for the slot's next user.
				rc.drain()
				return
			}
			rc.drain()
			close(reply)
		}
	}
}

// drain takes in what is buffered: at least every return sent before the
// caller of of saw its message's confirm.
func (rc *returnCollector) drain() {
	for {
		select {
		case r, ok := <-rc.returns:
			if !ok {
				return
			}
			rc.add(r)
		default:
			return
		}
	}
}

func (rc *returnCollector) add(r amqp091.Return) {
	id, _ := r.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
	rc.mu.Lock()
	rc.got[id] = append(rc.got[id], r)
	rc.mu.Unlock()
}

// of reports whether the broker returned message id, whose confirm has
// come: the broker sends a message's basic.return before its basic.ack on
// the same channel, and amqp091 dispatches both, in order, from one
// goroutine, so the return is buffered or taken in by now.
func (rc *returnCollector) of(id string) (amqp091.Return, bool) {
	if rc.returns == nil {
		return amqp091.Return{}, false
	}
	reply := make(chan struct{})
	select {
	case rc.sync <- reply:
		<-reply
	case <-rc.done: // the returns channel closed: all were taken in
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rs := rc.got[id]
	if len(rs) == 0 {
		return amqp091.Return{}, false
	}
	rc.got[id] = rs[1:]
	return rs[0], true
}

// stop ends the gathering; returns still to come belong to no message of
// the lane (every confirm is in).
func (rc *returnCollector) stop() {
	if rc.returns == nil {
		return
	}
	close(rc.sync)
	<-rc.done
}

// channelGone is why the broker closed s's channel, if it said (nil once
// the channel is discarded), forgetting topic's exchange if it was deleted.
func (p *publisher) channelGone(s *slot, topic string) *amqp091.Error {
	why := s.closeReason()
	if why != nil && why.Code == amqp091.NotFound {
		p.forget(topic) // the exchange was deleted: declare it again
	}
	return why
}

// maxSizeRe matches the reason RabbitMQ closes a channel with (406
// PRECONDITION_FAILED) when a message's body is over max_message_size
// (rabbit_channel.erl: "message size ~B is larger than configured max
// size ~B").
var maxSizeRe = regexp.MustCompile(`message size (\d+) is larger than configured max size (\d+)`)

// tooLarge reports whether the broker closed the channel because of a body
// of size bytes: the close names the size of the body it refused, so of
// the messages in flight on the channel only those over the limit it
// names are at fault.
func tooLarge(why *amqp091.Error, size int) bool {
	if why == nil || why.Code != amqp091.PreconditionFailed {
		return false
	}
	m := maxSizeRe.FindStringSubmatch(why.Reason)
	if m == nil {
		return false
	}
	limit, err := strconv.Atoi(m[2])
	return err == nil && size > limit
}
