package sql

import (
	"context"
	"errors"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
)

// upstreamSubscriber is what the wrapper needs of watermill-sql's
// subscriber; an interface so a test can stand in for it.
type upstreamSubscriber interface {
	message.Subscriber
	message.SubscribeInitializer
}

// subscriber is watermill-sql's subscriber (so also a
// message.SubscribeInitializer) that tells the transport's horizon
// monitor which topics it consumes, for as long as it does, and whose
// Close returns only once every channel it handed out is closed.
//
// watermill-sql v3.1.0's Close waits for its consume loops, but each loop
// closes its channel after it has told Close it is done, so Close can
// return with a channel still open (Watermill's conformance suite saw
// "messages channel is not closed (blocked)"). Once the loop is done
// nothing more is sent on the channel, so waiting for it to close here
// takes no message from the reader.
type subscriber struct {
	upstream upstreamSubscriber
	mon      *horizonMonitor // nil when the check is disabled

	mu      sync.Mutex
	open    map[<-chan *message.Message]struct{} // channels not yet closed by their ctx
	closing chan struct{}
	closed  bool
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

func newSubscriber(s upstreamSubscriber, mon *horizonMonitor) *subscriber {
	return &subscriber{
		upstream: s,
		mon:      mon,
		open:     map[<-chan *message.Message]struct{}{},
		closing:  make(chan struct{}),
	}
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
	err := s.upstream.SubscribeInitialize(topic)
	if lostCreateRace(err) {
		err = s.upstream.SubscribeInitialize(topic)
	}
	return err
}

// Subscribe subscribes as watermill-sql does (again once after losing a
// concurrent creation of the topic's tables); the topic is watched until
// ctx ends or the subscriber closes.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ch, err := s.upstream.Subscribe(ctx, topic)
	if lostCreateRace(err) {
		ch, err = s.upstream.Subscribe(ctx, topic)
	}
	if err != nil {
		return ch, err
	}
	s.mu.Lock()
	if s.closed {
		// Subscribe raced Close; watermill-sql refuses a closed
		// subscriber itself, so this only guards the bookkeeping.
		s.mu.Unlock()
		return ch, nil
	}
	s.open[ch] = struct{}{}
	s.mu.Unlock()

	unwatch := func() {}
	if s.mon != nil {
		unwatch = s.mon.watch(topic)
	}
	go func() {
		select {
		case <-ctx.Done():
			// The channel closes on its own; Close need not wait for it.
			s.mu.Lock()
			delete(s.open, ch)
			s.mu.Unlock()
		case <-s.closing:
		}
		unwatch()
	}()
	return ch, nil
}

// Close closes watermill-sql's subscriber and returns once every channel
// Subscribe returned is closed. It is idempotent.
func (s *subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	open := make([]<-chan *message.Message, 0, len(s.open))
	for ch := range s.open {
		open = append(open, ch)
	}
	s.mu.Unlock()

	err := s.upstream.Close()
	for _, ch := range open {
		for range ch {
			// Unreachable once upstream's loops are done; a message here
			// would be one Close cannot hand to anybody, and upstream
			// leaves it unacked, so the broker redelivers it.
		}
	}
	return err
}
