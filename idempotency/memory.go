package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// MemoryStore keeps marks in process memory, for unit tests of handlers and
// for single-process tools. It behaves like the Postgres store: marks of a
// unit of work are invisible until Commit, and a Mark that meets another
// unit's uncommitted mark waits for that unit to finish, at most the lock
// timeout (WithLockTimeout, default DefaultLockTimeout), then fails with
// ErrMarkLocked. Marks are never expired; the store is not for production
// consumers.
type MemoryStore struct {
	mu          sync.Mutex
	marks       map[memKey]*memMark
	lockTimeout time.Duration
}

type memKey struct{ consumer, eventID string }

type memMark struct {
	owner       *memTx // nil once committed
	processedAt time.Time
	settled     chan struct{} // closed when owner commits or rolls back
}

// NewMemoryStore returns an empty in-memory store. Its one option is
// WithLockTimeout.
func NewMemoryStore(opts ...StoreOption) *MemoryStore {
	return &MemoryStore{marks: map[memKey]*memMark{}, lockTimeout: applyOptions(opts).lockTimeout}
}

// Begin starts a unit of work.
func (s *MemoryStore) Begin(ctx context.Context) (Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &memTx{store: s}, nil
}

// Processed reports whether a committed mark exists.
func (s *MemoryStore) Processed(ctx context.Context, consumer, eventID string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.marks[memKey{consumer, eventID}]
	return ok && m.owner == nil, nil
}

// Mark writes one mark in a unit of work of its own (Marker).
func (s *MemoryStore) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	tx, err := s.Begin(ctx)
	if err != nil {
		return false, err
	}
	fresh, err := tx.Mark(ctx, consumer, eventID)
	if err != nil {
		_ = tx.Rollback()
		return false, err
	}
	return fresh, tx.Commit()
}

// Len returns the number of committed marks.
func (s *MemoryStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, m := range s.marks {
		if m.owner == nil {
			n++
		}
	}
	return n
}

var errMemTxDone = errors.New("idempotency: memory store unit of work already committed or rolled back")

type memTx struct {
	store *MemoryStore
	keys  []memKey
	done  bool
}

func (t *memTx) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	k := memKey{consumer, eventID}
	s := t.store
	// The bound a Postgres mark gets from lock_timeout: without it a unit
	// of work that never ends (a handler that hangs, one that marks its
	// own event again through a nested middleware) would hold this wait
	// as long as ctx, often forever in a test.
	var expired <-chan time.Time
	if s.lockTimeout >= 0 {
		timer := time.NewTimer(s.lockTimeout)
		defer timer.Stop()
		expired = timer.C
	}
	for {
		s.mu.Lock()
		if t.done {
			s.mu.Unlock()
			return false, errMemTxDone
		}
		m, ok := s.marks[k]
		switch {
		case !ok:
			s.marks[k] = &memMark{owner: t, processedAt: time.Now(), settled: make(chan struct{})}
			t.keys = append(t.keys, k)
			s.mu.Unlock()
			return true, nil
		case m.owner == nil || m.owner == t:
			s.mu.Unlock()
			return false, nil
		}
		settled := m.settled
		s.mu.Unlock()
		select {
		case <-settled:
		case <-ctx.Done():
			return false, ctx.Err()
		case <-expired:
			return false, fmt.Errorf("idempotency: marking consumer %q event %q: waited %s (lock timeout): %w",
				consumer, eventID, s.lockTimeout, ErrMarkLocked)
		}
	}
}

func (t *memTx) Commit() error {
	return t.finish(true)
}

func (t *memTx) Rollback() error {
	_ = t.finish(false)
	return nil
}

func (t *memTx) finish(commit bool) error {
	s := t.store
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.done {
		return errMemTxDone
	}
	t.done = true
	for _, k := range t.keys {
		m := s.marks[k]
		if commit {
			m.owner = nil
		} else {
			delete(s.marks, k)
		}
		close(m.settled)
	}
	t.keys = nil
	return nil
}
