package batch

import "github.com/ThreeDotsLabs/watermill/message"

// Publisher is the optional ability of a publisher to send many messages
// to one topic in one round trip; package transport re-exports it as
// transport.BatchPublisher, and the outbox relay, which must not import
// every transport through package transport, uses it from here.
//
// Implementations must be safe for concurrent use. Messages with the same
// metadata.OrderingKey keep their relative order, also under partial
// failure: once a message of a key fails, no later message of that key in
// the call may reach the broker (report them failed, not sent). Otherwise
// the broker can hold a later message before the failed one, and when the
// caller publishes the failed ones again, a consumer that drops duplicates
// applies the later one first.
type Publisher interface {
	message.Publisher
	// PublishBatch publishes msgs to topic. It returns nil when all were
	// accepted. When only some were, it returns an *Error naming the
	// failed ones; any other error means none can be assumed published.
	PublishBatch(topic string, msgs ...*message.Message) error
}
