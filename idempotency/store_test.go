package idempotency_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/pgtest"
)

func TestMemoryStore(t *testing.T) {
	t.Parallel()
	idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
		return idempotency.NewMemoryStore()
	})
}

// TestPostgresStore runs the store suite on a plain lib/pq pool (BeginMark
// is Begin then Mark there) and on a pool of millwright's own connections
// (internal/pgconn: the mark travels with BEGIN).
func TestPostgresStore(t *testing.T) {
	t.Parallel()
	for _, pool := range []string{"lib/pq", "pgconn"} {
		t.Run(pool, func(t *testing.T) {
			t.Parallel()
			idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
				s := pgtest.New(t, idempotency.Migrations())
				db := s.DB
				if pool == "pgconn" {
					db = pgconnPool(t, s)
				}
				// A cancel that reaches the server before the waiting
				// statement is lost (lib/pq sends it on another
				// connection); the lock timeout then ends
				// WaitingMarkStopsWithContext's wait, which once hung 20
				// minutes. The cancellation itself is proven by
				// TestMarkWaitingReturnsWhenItsContextIsCancelled.
				store, err := idempotency.NewPostgresStore(db, idempotency.WithLockTimeout(2*time.Second))
				if err != nil {
					t.Fatal(err)
				}
				return store
			})
		})
	}
}

// pgconnPool opens a pool of millwright's own connections on s, closed at
// cleanup.
func pgconnPool(t *testing.T, s *pgtest.Schema) *sql.DB {
	t.Helper()
	db, err := pgconn.Open(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(pgtest.MaxOpenConns)
	t.Cleanup(func() { db.Close() })
	return db
}
