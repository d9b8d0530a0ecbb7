package transport

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// checkedSubscriber refuses topics outside the allow-list.
type checkedSubscriber struct {
	message.Subscriber
	names *nameCache
}

func (s *checkedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.names.check("topic", topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// checkedInitSubscriber is checkedSubscriber for a subscriber that can
// create its topic up front (message.SubscribeInitializer).
type checkedInitSubscriber struct {
	checkedSubscriber
	init message.SubscribeInitializer
}

func (s *checkedInitSubscriber) SubscribeInitialize(topic string) error {
	if err := s.names.check("topic", topic); err != nil {
		return err
	}
	return s.init.SubscribeInitialize(topic)
}

func wrapSubscriber(sub message.Subscriber, names *nameCache) message.Subscriber {
	cs := checkedSubscriber{Subscriber: sub, names: names}
	if si, ok := sub.(message.SubscribeInitializer); ok {
		return &checkedInitSubscriber{checkedSubscriber: cs, init: si}
	}
	return &cs
}
