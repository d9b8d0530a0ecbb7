package kafka

import (
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// SetKeyedUnmarshaler replaces how a KeyedSubscriber reads messages.
func SetKeyedUnmarshaler(sub message.Subscriber, u wkafka.Unmarshaler) {
	sub.(*KeyedSubscriber).unmarshaler = u
}
