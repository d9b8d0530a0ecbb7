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
	// woken, if set, returns a watermill-sql subscriber of its own for one
	// Subscribe, woken by the topic table's notifications (notify.go),
	// and the function that stops them; nil: upstream polls.
	woken func(ctx context.Context, topic string) (upstreamSubscriber, func(), error)
	// ownUps are woken's subscribers, closed by Close.
	ownUps []upstreamSubscriber

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
	up, unwake, err := s.upstreamFor(ctx, topic)
	if err != nil {
		return nil, err
	}
	ch, err := up.Subscribe(ctx, topic)
	if lostCreateRace(err) {
		ch, err = up.Subscribe(ctx, topic)
	}
	if err != nil {
		unwake()
		return ch, err
	}
	s.mu.Lock()
	if s.closed {
		// Subscribe raced Close; watermill-sql refuses a closed
		// subscriber itself, so this only guards the bookkeeping.
		s.mu.Unlock()
		unwake()
		return ch, nil
	}
	s.open[ch] = struct{}{}
	s.mu.Unlock()

	unwatch := unwake
	if s.mon != nil {
		unmon := s.mon.watch(topic)
		unwatch = func() { unmon(); unwake() }
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

// upstreamFor returns the watermill-sql subscriber one Subscribe of topic
// runs on, and the function that stops its notifications.
func (s *subscriber) upstreamFor(ctx context.Context, topic string) (upstreamSubscriber, func(), error) {
	if s.woken == nil {
		return s.upstream, func() {}, nil
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return s.upstream, func() {}, nil // refuses: closed
	}
	up, unwake, err := s.woken(ctx, topic)
	if err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	if s.closed { // Close ran meanwhile: it would not close up
		s.mu.Unlock()
		unwake()
		_ = up.Close()
		return s.upstream, func() {}, nil // refuses: closed
	}
	s.ownUps = append(s.ownUps, up)
	s.mu.Unlock()
	return up, unwake, nil
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
	ups := append([]upstreamSubscriber{s.upstream}, s.ownUps...)
	s.mu.Unlock()

	var errs []error
	for _, up := range ups {
		errs = append(errs, up.Close())
	}
	err := errors.Join(errs...)
	for _, ch := range open {
		for range ch {
			// Unreachable once upstream's loops are done; a message here
			// would be one Close cannot hand to anybody, and upstream
			// leaves it unacked, so the broker redelivers it.
		}
	}
	return err
}
