package idempotency_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

func TestMemoryStore(t *testing.T) {
	t.Parallel()
	idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
		return idempotency.NewMemoryStore()
	})
}

// TestPostgresStore runs the store suite on each driver: on pq, a plain
// lib/pq pool (BeginMark is Begin then Mark there) and a pool of
// millwright's own connections (internal/pgconn: the mark travels with
// BEGIN); on pgx, a pgxpool (the mark travels with BEGIN).
func TestPostgresStore(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		pools := []string{"pgxpool"}
		if driver == pgtest.DriverPQ {
			pools = []string{"lib/pq", "pgconn"}
		}
		for _, pool := range pools {
			t.Run(pool, func(t *testing.T) {
				t.Parallel()
				idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
					return suiteStore(t, pool)
				})
			})
		}
	})
}

// suiteStore is the suite's store on pool. A cancel that reaches the
// server before the waiting statement is lost (lib/pq sends it on another
// connection); the lock timeout then ends WaitingMarkStopsWithContext's
// wait, which once hung 20 minutes. The cancellation itself is proven by
// TestMarkWaitingReturnsWhenItsContextIsCancelled.
func suiteStore(t *testing.T, pool string) idempotency.Store {
	s := pgtest.New(t, idempotency.Migrations())
	opt := idempotency.WithLockTimeout(2 * time.Second)
	var (
		store *idempotency.PostgresStore
		err   error
	)
	switch pool {
	case "lib/pq":
		store, err = idempotency.NewPostgresStore(postgres.From(s.DB), opt)
	case "pgconn":
		store, err = idempotency.NewPostgresStore(postgres.From(pgconnPool(t, s)), opt)
	default:
		store, err = idempotency.NewPostgresStore(postgres.From(s.Pgx(t)), opt)
	}
	if err != nil {
		t.Fatal(err)
	}
	return store
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
