package googlecloud

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// PublishBatch publishes msgs to topic one at a time, as Publish does, but
// answers for each message (transport.BatchPublisher): a message Pub/Sub
// refuses for good (classify) fails alone, the messages before it stay
// published, and of the messages after it only those of its ordering key
// are held back (not sent: the client pauses the key after a failure and
// the key must stay in order); the others go on. Publish, which returns
// one error for the whole call, cannot say which message was refused, so
// the outbox relay, which publishes many rows per call, would have failed
// every one of them with the refused message's permanent error.
func (p *Publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	if err := p.prepare(topic, msgs); err != nil {
		return err
	}
	failed := map[int]error{}
	stopped := map[string]string{} // ordering key -> UUID of its failed message
	for i, m := range msgs {
		key := m.Metadata.Get(metadata.OrderingKey)
		if id, ok := stopped[key]; ok && key != "" {
			failed[i] = fmt.Errorf("googlecloud: message %s not sent: message %s before it with ordering key %q failed; publish it again after that one", m.UUID, id, key)
			continue
		}
		if err := classify(p.Publisher.Publish(topic, m)); err != nil {
			failed[i] = err
			if key != "" {
				stopped[key] = m.UUID
			}
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &transport.BatchError{Failed: failed}
}

var _ transport.BatchPublisher = (*Publisher)(nil)
