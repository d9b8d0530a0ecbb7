package transport

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/batch"
)

// BatchPublisher is the optional ability of a publisher to send many
// messages to one topic in one round trip. The outbox relay uses it when the
// transport's publisher has it and falls back to Publish otherwise.
//
// Implementations must be safe for concurrent use. Messages with the same
// metadata.OrderingKey keep their relative order.
type BatchPublisher interface {
	message.Publisher
	// PublishBatch publishes msgs to topic. It returns nil when all were
	// accepted. When only some were, it returns a *BatchError naming the
	// failed ones; any other error means none can be assumed published.
	PublishBatch(topic string, msgs ...*message.Message) error
}

// BatchError reports which messages of a PublishBatch call were not published.
type BatchError = batch.Error
