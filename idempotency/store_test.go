package idempotency_test

import (
	"testing"

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
		store, err := idempotency.NewPostgresStore(s.DB)
		if err != nil {
			t.Fatal(err)
		}
		return store
	})
}
