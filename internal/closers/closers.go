// Package closers tracks what a transport opened, so that its Close closes
// every subscriber first and then the rest, once.
package closers

import (
	"errors"
	"fmt"
	"io"
	"sync"
)

// Set holds the subscribers a transport made. The zero value is ready.
type Set struct {
	mu     sync.Mutex
	subs   []io.Closer
	closed bool
}

// Add runs open under the set's lock, unless the set is closed, and keeps
// what it returns for Close. kind names the transport in the error.
func Add[S io.Closer](s *Set, kind string, open func() (S, error)) (S, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var zero S
	if s.closed {
		return zero, fmt.Errorf("%s: transport is closed", kind)
	}
	v, err := open()
	if err != nil {
		return zero, err
	}
	s.subs = append(s.subs, v)
	return v, nil
}

// Close closes every subscriber, then runs each of then in order (the
// publisher, the connection), and joins their errors. Only the first call
// does anything; later ones return nil.
func (s *Set) Close(then ...func() error) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	subs := s.subs
	s.mu.Unlock()
	var errs []error
	for _, c := range subs {
		errs = append(errs, c.Close())
	}
	for _, f := range then {
		errs = append(errs, f())
	}
	return errors.Join(errs...)
}
