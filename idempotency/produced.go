package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// ErrNoProducedDestination is returned by the middleware, wrapped in
// failure.Permanent, when the handler returned messages and the Config names
// no destination for them (neither Config.ProducedToOutbox nor
// Config.ProducedPublisher), or no topic (Config.ProducedTopic empty and
// the router handler has no publish topic). The middleware never hands
// produced messages back to Watermill's router: the router publishes them
// only after the mark has committed, so a failed publish would leave a
// marked event whose follow-ups were never sent, and its redelivery would
// be skipped as a duplicate. The message is not marked (in Transactional
// mode the handler's effects roll back) and the dead-letter path parks it
// with this reason; fix the Config and replay it. Test with
// errors.Is(err, ErrNoProducedDestination).
var ErrNoProducedDestination = errors.New("handler returned messages but the idempotency middleware has nowhere to send them")

// producedIDSpace is the UUID namespace of the event ids given to produced
// messages that carry none (see producedEventID).
var producedIDSpace = uuid.MustParse("198e4517-0526-4544-a795-0e2c65c8f12c")

// producedEventID is the metadata.EventID given to the i-th message the
// handler returned for consumer's event eventID when the message carries
// none: a name-based UUID, so a run repeated after a failed publish or a
// failed commit gives its copy the same id, and a downstream idempotency
// middleware drops it.
func producedEventID(consumer, eventID string, i int) string {
	return uuid.NewSHA1(producedIDSpace, []byte(consumer+"\x00"+eventID+"\x00"+strconv.Itoa(i))).String()
}

// sendProduced sends the messages the handler returned for event id to the
// configured destination, before the mark commits: into the outbox through
// tx (Config.ProducedToOutbox; tx is the unit of work that holds the mark),
// or through Config.ProducedPublisher (tx unused). An error means they may
// not all have been sent; the caller must then not commit the mark.
func (m *Middleware) sendProduced(ctx context.Context, id string, tx Tx, produced []*message.Message) error {
	if len(produced) == 0 {
		return nil
	}
	for i, p := range produced {
		if p == nil {
			return failure.Permanent(fmt.Errorf("idempotency: consumer %q event %q: the handler returned a nil message at index %d of %d",
				m.cfg.Consumer, id, i, len(produced)))
		}
	}
	if !m.cfg.ProducedToOutbox && m.cfg.ProducedPublisher == nil {
		return failure.Permanent(fmt.Errorf("idempotency: consumer %q event %q: %w (%d message(s)): set Config.ProducedToOutbox to write them to the outbox with the mark (published by the relay), or Config.ProducedPublisher to publish them before the mark commits; the router's own publish comes after the commit and loses them when it fails",
			m.cfg.Consumer, id, ErrNoProducedDestination, len(produced)))
	}
	topic := m.cfg.ProducedTopic
	if topic == "" {
		topic = message.PublishTopicFromCtx(ctx)
	}
	if topic == "" {
		return failure.Permanent(fmt.Errorf("idempotency: consumer %q event %q: %w (%d message(s)): no topic: set Config.ProducedTopic, or register the handler with Router.AddHandler and a publish topic",
			m.cfg.Consumer, id, ErrNoProducedDestination, len(produced)))
	}

	if m.cfg.ProducedToOutbox {
		st, ok := tx.(DatabaseTx)
		if !ok {
			return failure.Permanent(fmt.Errorf("idempotency: consumer %q event %q: Config.ProducedToOutbox needs a store whose units of work are database transactions (PostgresStore), not %T: use NewPostgresStore, or Config.ProducedPublisher",
				m.cfg.Consumer, id, tx))
		}
		events := make([]outbox.Event, len(produced))
		for i, p := range produced {
			events[i] = outbox.MessageEvent(topic, p)
		}
		// ctx is the consumed message's: its span becomes the events'
		// traceparent unless a message carries its own. The transaction
		// is the store's driver's: a *sql.Tx or a pgx.Tx.
		if err := outbox.Add(ctx, st.DatabaseTx(), events...); err != nil {
			err = fmt.Errorf("idempotency: consumer %q event %q: writing %d produced message(s) to the outbox (topic %q), the mark is not committed: %w",
				m.cfg.Consumer, id, len(produced), topic, err)
			if errors.Is(err, outbox.ErrInvalidEvent) {
				return failure.Permanent(err) // the same messages fail every run
			}
			return err
		}
		return nil
	}

	for i, p := range produced {
		if p.Metadata == nil {
			p.Metadata = message.Metadata{}
		}
		if p.Context() == context.Background() {
			// A message made with NewMessage carries no deadline; the
			// consumed message's context bounds the publish that holds the
			// mark's transaction (and, on most transports, its wait for
			// the broker's confirm).
			p.SetContext(ctx)
		}
		if p.Metadata.Get(metadata.EventID) == "" {
			p.Metadata.Set(metadata.EventID, producedEventID(m.cfg.Consumer, id, i))
		}
	}
	if err := m.cfg.ProducedPublisher.Publish(topic, produced...); err != nil {
		return fmt.Errorf("idempotency: consumer %q event %q: publishing %d produced message(s) to topic %q failed, the mark is not committed and the redelivery runs the handler again: %w",
			m.cfg.Consumer, id, len(produced), topic, err)
	}
	return nil
}

// markWithProduced is MarkAfterSuccess mode's mark when the produced
// messages go to the outbox: one unit of work writes the mark and, when
// the mark is fresh, the messages, and commits both. When another delivery
// marked the event first, nothing is written (its own produced messages
// committed with its mark) and fresh is false.
func (m *Middleware) markWithProduced(ctx context.Context, id string, produced []*message.Message) (bool, error) {
	tx, fresh, err := m.beginMark(ctx, id)
	if err != nil {
		return false, err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if !fresh {
		return false, nil
	}
	if err := m.sendProduced(ctx, id, tx, produced); err != nil {
		return false, err
	}
	return true, tx.Commit()
}
