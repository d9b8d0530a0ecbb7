package sql

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
)

// TestLostCreateRace: the errors Postgres gives the loser of two concurrent
// CREATE TABLE IF NOT EXISTS of one table (seen in watermill's suite:
// "could not initialize schema: pq: duplicate key value violates unique
// constraint \"pg_type_typname_nsp_index\"") are taken as "the table now
// exists", wrapped as watermill-sql wraps them; other errors are not.
func TestLostCreateRace(t *testing.T) {
	t.Parallel()
	typeIndex := &pq.Error{Code: "23505", Constraint: "pg_type_typname_nsp_index",
		Message: `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{typeIndex, true},
		{fmt.Errorf("could not initialize schema: %w", typeIndex), true},
		{&pq.Error{Code: "23505", Message: `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`}, true},
		{&pq.Error{Code: "42P07", Message: `relation "watermill_x" already exists`}, true},
		{&pq.Error{Code: "23505", Constraint: "watermill_x_pkey", Message: "duplicate key value"}, false},
		{&pq.Error{Code: "42501", Message: "permission denied for schema public"}, false},
		{errors.New("pg_type_typname_nsp_index"), false},
		{nil, false},
	} {
		if got := lostCreateRace(tc.err); got != tc.want {
			t.Errorf("lostCreateRace(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// lateClosingSubscriber stands in for watermill-sql v3.1.0's subscriber,
// whose Close can return before the channels it handed out are closed:
// it closes them after Close returned, once release is closed (20 ms
// later when release is nil).
type lateClosingSubscriber struct {
	mu      sync.Mutex
	chans   []chan *message.Message
	later   sync.WaitGroup
	release chan struct{}
}

func (l *lateClosingSubscriber) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ch := make(chan *message.Message)
	l.chans = append(l.chans, ch)
	return ch, nil
}

func (l *lateClosingSubscriber) SubscribeInitialize(string) error { return nil }

func (l *lateClosingSubscriber) Close() error {
	l.mu.Lock()
	chans := l.chans
	l.mu.Unlock()
	release := l.release
	l.later.Add(1)
	go func() {
		defer l.later.Done()
		// The fault: the channels close after Close returned.
		if release != nil {
			<-release
		} else {
			<-time.After(20 * time.Millisecond)
		}
		for _, ch := range chans {
			close(ch)
		}
	}()
	return nil
}

// TestSubscriberCloseReturnsWithChannelsClosed: the wrapper's Close returns
// only once every channel Subscribe gave out is closed, although the
// subscriber it wraps closes them late (the fault is checked: right after
// the wrapped Close, the channels were still open).
func TestSubscriberCloseReturnsWithChannelsClosed(t *testing.T) {
	t.Parallel()
	up := &lateClosingSubscriber{}
	s := newSubscriber(up, nil)
	var chans []<-chan *message.Message
	for i := range 3 {
		ch, err := s.Subscribe(context.Background(), fmt.Sprintf("topic_%d", i))
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	// The fault as the wrapped subscriber shows it alone.
	bare := &lateClosingSubscriber{release: make(chan struct{})}
	bareCh, _ := bare.Subscribe(context.Background(), "t")
	_ = bare.Close()
	select {
	case <-bareCh:
		t.Fatal("the stand-in closed its channel before Close returned: it no longer injects the fault")
	default:
	}
	close(bare.release)
	bare.later.Wait()

	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for i, ch := range chans {
		select {
		case _, open := <-ch:
			if open {
				t.Errorf("channel %d delivered a message after Close", i)
			}
		default:
			t.Errorf("channel %d is still open after Close returned", i)
		}
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	up.later.Wait()
}
