package outbox

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

// TxPublisher is a Watermill message.Publisher that writes messages to the
// outbox in the caller's transaction instead of sending them. Code written
// against message.Publisher, Watermill's CQRS EventBus included, gets the
// outbox by being given a TxPublisher bound to its transaction.
//
// Each message becomes one row: its UUID is the event id, its metadata is
// kept, metadata.AggregateType/AggregateID (or else metadata.OrderingKey)
// name its aggregate, metadata.EventType its type. A message without an
// aggregate is unordered. See Event for how payloads are stored.
//
// A TxPublisher is as safe for concurrent use as its transaction (neither
// driver's is). It is cheap: create one per transaction.
type TxPublisher struct {
	tx  postgres.Tx
	cfg PublisherConfig
}

// PublisherConfig configures a TxPublisher.
type PublisherConfig struct {
	// Source is the CloudEvents source set on messages that carry none.
	// Default "" (not set).
	Source string
	// RawPayloads stores every payload byte for byte, JSON included (see
	// Event.RawPayload). Default false.
	RawPayloads bool
	// Writer checks and writes the messages: its limits are those of the
	// relay's transport, its source the one of messages that carry none
	// and of a config without Source. Default nil: the package-level Add's.
	Writer *Writer
}

// NewTxPublisher returns a publisher that writes to the outbox in tx, the
// caller's transaction.
func NewTxPublisher(tx postgres.Tx, cfg PublisherConfig) (*TxPublisher, error) {
	if err := tx.Valid(); err != nil {
		return nil, fmt.Errorf("outbox: NewTxPublisher: %w", err)
	}
	return &TxPublisher{tx: tx, cfg: cfg}, nil
}

// Publish writes msgs to the outbox with one INSERT. The context of the
// first message is used for the statement (Watermill's Publish has none).
func (p *TxPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	if ctx == nil {
		ctx = context.Background()
	}
	events := make([]Event, len(msgs))
	for i, m := range msgs {
		events[i] = MessageEvent(topic, m)
		events[i].RawPayload = p.cfg.RawPayloads
		if events[i].Source == "" {
			events[i].Source = p.cfg.Source
		}
	}
	return p.cfg.Writer.Add(ctx, p.tx, events...)
}

// Close does nothing: the transaction belongs to the caller.
func (p *TxPublisher) Close() error { return nil }

var _ message.Publisher = (*TxPublisher)(nil)

// MessageEvent maps a Watermill message to the Event a TxPublisher writes.
func MessageEvent(topic string, m *message.Message) Event {
	md := make(map[string]string, len(m.Metadata))
	for k, v := range m.Metadata {
		md[k] = v
	}
	aggID := md[metadata.AggregateID]
	if aggID == "" {
		aggID = md[metadata.OrderingKey]
	}
	return Event{
		Topic:         topic,
		AggregateType: md[metadata.AggregateType],
		AggregateID:   aggID,
		EventType:     md[metadata.EventType],
		Payload:       m.Payload,
		Metadata:      md,
		ID:            m.UUID,
		Source:        md[metadata.EventSource],
	}
}
