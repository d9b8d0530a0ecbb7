package sql

import (
	"context"
	"sync"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// subscriber is watermill-sql's subscriber (so also a
// message.SubscribeInitializer) that tells the transport's horizon
// monitor which topics it consumes, for as long as it does.
type subscriber struct {
	*wsql.Subscriber
	mon *horizonMonitor // nil when the check is disabled

	closeOnce sync.Once
	closing   chan struct{}
}

func newSubscriber(s *wsql.Subscriber, mon *horizonMonitor) *subscriber {
	return &subscriber{Subscriber: s, mon: mon, closing: make(chan struct{})}
}

// Subscribe subscribes as watermill-sql does; the topic is watched until
// ctx ends or the subscriber closes.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ch, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil || s.mon == nil {
		return ch, err
	}
	unwatch := s.mon.watch(topic)
	go func() {
		select {
		case <-ctx.Done():
		case <-s.closing:
		}
		unwatch()
	}()
	return ch, nil
}

// Close closes watermill-sql's subscriber. It is idempotent.
func (s *subscriber) Close() error {
	err := s.Subscriber.Close()
	s.closeOnce.Do(func() { close(s.closing) })
	return err
}
