package idempotency_test

import (
	"testing"
	"time"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/pgtest"
)

func TestMemoryStore(t *testing.T) {
	t.Parallel()
	idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
		return idempotency.NewMemoryStore()
	})
}

func TestPostgresStore(t *testing.T) {
	t.Parallel()
	idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
		s := pgtest.New(t, idempotency.Migrations())
		// A cancel that reaches the server before the waiting statement
		// is lost (lib/pq sends it on another connection); the lock
		// timeout then ends WaitingMarkStopsWithContext's wait, which
		// once hung 20 minutes. The cancellation itself is proven by
		// TestMarkWaitingReturnsWhenItsContextIsCancelled.
		store, err := idempotency.NewPostgresStore(s.DB, idempotency.WithLockTimeout(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		return store
	})
}
