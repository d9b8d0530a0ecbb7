package nats

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// UUIDHeader carries the Watermill message UUID: watermill-nats's header,
// so that its publishers and subscribers read millwright's messages and
// the other way round.
const UUIDHeader = wmnats.WatermillUUIDHdr

// ErrNotSent is wrapped by the error of a message a Publish or
// PublishBatch did not send because an earlier message of its ordering key
// failed (see Publisher).
var ErrNotSent = errors.New("not sent: an earlier message of its ordering key failed")

// ErrClosed is returned by Publish after Close.
var ErrClosed = errors.New("nats: publisher is closed")

// Publisher publishes to JetStream: each topic's stream is created on its
// first publish (Transport.ensureStream), every message carries its UUID
// (the outbox event id) as Nats-Msg-Id, so the stream's duplicate window
// drops a message published again, and Publish returns nil only once the
// stream acknowledged (stored) every message.
//
// Messages of one metadata.OrderingKey are sent one at a time, each once
// the previous one was acknowledged; different keys (and messages without
// a key) are in flight together. A key stops at its first failure: its
// later messages are reported not sent (ErrNotSent), so the stream never
// holds a message of a key after one that failed, and publishing the
// failed ones again keeps each key in order.
type Publisher struct {
	t       *Transport
	closeMu sync.RWMutex
	closed  bool
	closing chan struct{}
}

// Publish publishes msgs to topic as PublishBatch does; any failure is
// returned as an error (a *transport.BatchError when some were stored).
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	return p.PublishBatch(topic, msgs...)
}

// PublishBatch publishes msgs to topic (see Publisher). It returns nil when
// every message was stored, a *transport.BatchError naming the messages
// that were not when some were.
func (p *Publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	p.closeMu.RLock()
	defer p.closeMu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	if !p.t.knownStream(topic) {
		if _, err := p.t.ensureStream(ctx, topic); err != nil {
			return err
		}
	}
	// Each key's messages, in call order; a message without a key is a
	// key of its own.
	var order []string
	queues := map[string][]int{}
	for i, m := range msgs {
		k := m.Metadata.Get(metadata.OrderingKey)
		if k == "" {
			k = "\x00" + strconv.Itoa(i)
		}
		if _, ok := queues[k]; !ok {
			order = append(order, k)
		}
		queues[k] = append(queues[k], i)
	}
	failed := map[int]error{}
	for len(order) > 0 {
		heads := make([]int, len(order))
		for j, k := range order {
			heads[j] = queues[k][0]
		}
		errs := p.sendWave(topic, msgs, heads)
		next := order[:0]
		for j, k := range order {
			q := queues[k]
			if err := errs[j]; err != nil {
				failed[q[0]] = err
				for _, i := range q[1:] {
					failed[i] = fmt.Errorf("nats: message %s to topic %s %w: %w", msgs[i].UUID, topic, ErrNotSent, err)
				}
				continue
			}
			if q = q[1:]; len(q) > 0 {
				queues[k] = q
				next = append(next, k)
			}
		}
		order = next
	}
	switch {
	case len(failed) == 0:
		return nil
	case len(failed) == len(msgs) && len(msgs) == 1:
		return failed[0]
	}
	return &transport.BatchError{Failed: failed}
}

// sendWave publishes msgs[idx...] together and waits for each one's
// acknowledgement; errs[j] is idx[j]'s failure.
func (p *Publisher) sendWave(topic string, msgs []*message.Message, idx []int) []error {
	errs := make([]error, len(idx))
	futures := make([]jetstream.PubAckFuture, len(idx))
	for j, i := range idx {
		nm := Marshal(topic, msgs[i])
		f, err := p.t.js.PublishMsgAsync(nm, jetstream.WithMsgID(MsgID(msgs[i])))
		if err != nil {
			errs[j] = p.classify(topic, msgs[i], nm, err)
			continue
		}
		futures[j] = f
	}
	timer := time.NewTimer(p.t.cfg.ConnectTimeout)
	defer timer.Stop()
	for j, f := range futures {
		if f == nil {
			continue
		}
		m := msgs[idx[j]]
		select {
		case <-f.Ok():
		case err := <-f.Err():
			errs[j] = p.classify(topic, m, f.Msg(), err)
		case <-m.Context().Done():
			errs[j] = fmt.Errorf("nats: message %s to topic %s: no acknowledgement before its context ended (it may be stored; publishing it again within the duplicate window is dropped by the stream): %w", m.UUID, topic, m.Context().Err())
		case <-timer.C:
			errs[j] = fmt.Errorf("nats: message %s to topic %s: no acknowledgement from the stream within ConnectTimeout %s (it may be stored; publishing it again within the duplicate window is dropped by the stream)", m.UUID, topic, p.t.cfg.ConnectTimeout)
		case <-p.closing:
			errs[j] = fmt.Errorf("nats: message %s to topic %s: %w before its acknowledgement (it may be stored)", m.UUID, topic, ErrClosed)
		}
	}
	return errs
}

// classify marks what no retry can fix as failure.Permanent: a message
// over max_payload or the stream's max_msg_size (transport.ErrMessageTooLarge),
// a subject the server refuses (transport.ErrInvalidName). A stream that
// vanished (no responders) is created again by the next publish.
func (p *Publisher) classify(topic string, m *message.Message, nm *natsgo.Msg, err error) error {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, natsgo.ErrMaxPayload), errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum),
		errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		size := len(nm.Data)
		if hdr, herr := headerSize(nm); herr == nil {
			size += hdr
		}
		return failure.Permanent(fmt.Errorf("nats: message %s to topic %s: %w: %w: %d bytes with headers, over the server's max_payload (%d) or the stream's max_msg_size (raise them, or store large data elsewhere and send a reference)",
			m.UUID, topic, transport.ErrMessageTooLarge, err, size, p.t.nc.MaxPayload()))
	case errors.Is(err, natsgo.ErrBadSubject), errors.Is(err, jetstream.ErrInvalidSubject):
		return failure.Permanent(fmt.Errorf("nats: message %s: topic %q is not a valid subject: %w: %w", m.UUID, topic, transport.ErrInvalidName, err))
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, natsgo.ErrNoResponders), errors.Is(err, jetstream.ErrStreamNotFound):
		p.t.forgetStream(topic)
		return fmt.Errorf("nats: message %s to topic %s: no stream %s answered (deleted, or its server is down): the next publish creates it again: %w", m.UUID, topic, StreamName(topic), err)
	}
	return fmt.Errorf("nats: message %s to topic %s: %w", m.UUID, topic, err)
}

// MsgID is m's Nats-Msg-Id: its UUID (the outbox event id), so that the
// stream's duplicate window drops the same event published again (the
// relay after a lost acknowledgement); for a replayed dead letter
// (metadata.DeadLetterReplayOf), which keeps its event id on purpose, the
// UUID and "-replay-" and the dead letter's id, so that the replay is not
// taken for a duplicate of the original and dropped.
func MsgID(m *message.Message) string {
	if r := m.Metadata.Get(metadata.DeadLetterReplayOf); r != "" {
		return m.UUID + "-replay-" + r
	}
	return m.UUID
}

// headerSize is the encoded size of nm's headers.
func headerSize(nm *natsgo.Msg) (int, error) {
	n := 12
	for k, vs := range nm.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n, nil
}

// Close refuses new publishes (ErrClosed) and waits for those in flight.
// It is idempotent.
func (p *Publisher) Close() error {
	p.closeMu.Lock()
	defer p.closeMu.Unlock()
	if !p.closed {
		p.closed = true
		close(p.closing)
	}
	return nil
}

// Marshal is the NATS message of m for topic, in CloudEvents binary mode
// (the NATS protocol binding): each metadata.Event* attribute as a
// "ce-<attr>" header, datacontenttype as "content-type", other metadata
// under its own name, and the UUID in UUIDHeader. The publisher adds
// Nats-Msg-Id.
func Marshal(topic string, m *message.Message) *natsgo.Msg {
	h := natsgo.Header{}
	h[UUIDHeader] = []string{m.UUID}
	for k, v := range m.Metadata {
		if w := cloudevent.NATS.WireKey(k); w != "" {
			h[w] = []string{v}
		}
	}
	return &natsgo.Msg{Subject: topic, Data: m.Payload, Header: h}
}

// Unmarshal is the Watermill message of a JetStream message: Marshal's
// inverse. JetStream's own headers (Nats-*) are not metadata; a header
// with several values keeps its first.
func Unmarshal(nm jetstream.Msg) *message.Message {
	hdr := nm.Headers()
	md := make(message.Metadata, len(hdr))
	for k, vs := range hdr {
		if k == UUIDHeader || len(vs) == 0 || isNATSHeader(k) {
			continue
		}
		md[k] = vs[0]
	}
	cloudevent.NATS.Decode(md)
	m := message.NewMessage(hdr.Get(UUIDHeader), nm.Data())
	m.Metadata = md
	return m
}

func isNATSHeader(k string) bool {
	return len(k) > 5 && (k[:5] == "Nats-" || k[:5] == "nats-")
}
