package sql

import (
	"context"
	"errors"
	"strings"
	"sync"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
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

// lostCreateRace reports whether err is Postgres refusing one of two
// sessions that ran CREATE TABLE IF NOT EXISTS for the same table at the
// same moment: IF NOT EXISTS is checked before the catalog insert, so the
// loser fails on the catalog's unique index (pg_type's, for the table's
// row type) or with duplicate_table, although the table now exists.
func lostCreateRace(err error) bool {
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) {
		return false
	}
	return pqErr.Code == "42P07" || // duplicate_table
		(pqErr.Code == "23505" && (pqErr.Constraint == "pg_type_typname_nsp_index" ||
			strings.Contains(pqErr.Message, "pg_type_typname_nsp_index")))
}

// SubscribeInitialize creates the topic's tables as watermill-sql does,
// once more when it lost a concurrent creation of the same table (which
// then exists).
func (s *subscriber) SubscribeInitialize(topic string) error {
	err := s.Subscriber.SubscribeInitialize(topic)
	if lostCreateRace(err) {
		err = s.Subscriber.SubscribeInitialize(topic)
	}
	return err
}

// Subscribe subscribes as watermill-sql does (again once after losing a
// concurrent creation of the topic's tables); the topic is watched until
// ctx ends or the subscriber closes.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ch, err := s.Subscriber.Subscribe(ctx, topic)
	if lostCreateRace(err) {
		ch, err = s.Subscriber.Subscribe(ctx, topic)
	}
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
