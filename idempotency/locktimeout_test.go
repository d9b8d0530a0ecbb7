package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// TestMarkWaitingOnAnUncommittedMarkIsBounded: a Mark that waits for
// another unit of work's uncommitted mark of the same event gives up after
// the lock timeout with ErrMarkLocked (transient: retried later), instead
// of waiting as long as the other transaction lives.
func TestMarkWaitingOnAnUncommittedMarkIsBounded(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testMarkWaitingIsBounded(t, driver)
	})
}

func testMarkWaitingIsBounded(t *testing.T, driver string) {
	ctx := context.Background()
	s, tx := holdUncommittedMark(t, "billing", "evt-1")

	const lockTimeout = 300 * time.Millisecond
	waiter, err := idempotency.NewPostgresStore(postgres.From(s.DB), idempotency.WithLockTimeout(lockTimeout))
	if driver == pgtest.DriverPgx {
		waiter, err = idempotency.NewPostgresStore(postgres.From(s.Pgx(t)), idempotency.WithLockTimeout(lockTimeout))
	}
	require.NoError(t, err)
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := waiter.Mark(ctx, "billing", "evt-1")
		done <- err
	}()
	err = receive(t, done, "the waiting Mark's result")
	require.ErrorIs(t, err, idempotency.ErrMarkLocked)
	require.GreaterOrEqual(t, time.Since(start), lockTimeout, "it gave up before the lock timeout: it did not wait on the mark")
	require.Contains(t, err.Error(), `consumer "billing" event "evt-1"`)
	_, _, err = waiter.BeginMark(ctx, "billing", "evt-1")
	require.ErrorIs(t, err, idempotency.ErrMarkLocked, "BeginMark is bounded alike")

	// Once the holder commits, the same Mark finds the duplicate.
	require.NoError(t, tx.Commit())
	fresh, err := waiter.Mark(ctx, "billing", "evt-1")
	require.NoError(t, err)
	require.False(t, fresh)
}

// TestMarkWaitingReturnsWhenItsContextIsCancelled cancels a Mark only once
// the server shows it waiting on the other unit of work's lock, and without
// a lock timeout: only the cancellation can end it.
func TestMarkWaitingReturnsWhenItsContextIsCancelled(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testMarkWaitingIsCancelled(t, driver)
	})
}

func testMarkWaitingIsCancelled(t *testing.T, driver string) {
	ctx := context.Background()
	s, _ := holdUncommittedMark(t, "billing", "evt-1")
	waiter, pid := oneConnectionStore(t, s, driver)

	markCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := waiter.Mark(markCtx, "billing", "evt-1")
		done <- err
	}()
	poll.Until(t, 10*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("Mark returned before it waited: %v", err)
		default:
		}
		return pgtest.WaitingOnLock(t, s.DB, pid) == 1
	}, "the waiting Mark (pid %d) to wait on the lock", pid)
	cancel()
	err := receive(t, done, "the cancelled Mark's result")
	require.True(t, errors.Is(err, context.Canceled), "want context.Canceled, got %v", err)
}

// oneConnectionStore returns a store without a lock timeout on a pool of
// one connection of driver, and that connection's backend pid.
func oneConnectionStore(t *testing.T, s *pgtest.Schema, driver string) (*idempotency.PostgresStore, int) {
	t.Helper()
	var pid int
	if driver == pgtest.DriverPgx {
		cfg, err := pgconn.PgxConfig(s.URL)
		require.NoError(t, err)
		cfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
		waiter, err := idempotency.NewPostgresStore(postgres.From(pool), idempotency.WithLockTimeout(-1))
		require.NoError(t, err)
		return waiter, pid
	}
	waiterDB, err := sql.Open("postgres", s.URL)
	require.NoError(t, err)
	waiterDB.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = waiterDB.Close() })
	require.NoError(t, waiterDB.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	waiter, err := idempotency.NewPostgresStore(postgres.From(waiterDB), idempotency.WithLockTimeout(-1))
	require.NoError(t, err)
	return waiter, pid
}

// holdUncommittedMark marks an event in a unit of work of a fresh schema
// and leaves it uncommitted (rolled back at cleanup), so that another
// Mark of the same event waits on it.
func holdUncommittedMark(t *testing.T, consumer, eventID string) (*pgtest.Schema, idempotency.Tx) {
	t.Helper()
	s := pgtest.New(t, idempotency.Migrations())
	holder, err := idempotency.NewPostgresStore(postgres.From(s.DB))
	require.NoError(t, err)
	tx, err := holder.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	fresh, err := tx.Mark(context.Background(), consumer, eventID)
	require.NoError(t, err)
	require.True(t, fresh)
	return s, tx
}

// TestMemoryStoreMarkWaitingIsBounded: the in-memory store bounds the same
// wait as the Postgres store. Before, its Mark waited as long as its
// context, forever with context.Background(): a handler test whose unit of
// work never ended hung until the test binary's timeout.
func TestMemoryStoreMarkWaitingIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const lockTimeout = 300 * time.Millisecond
	store := idempotency.NewMemoryStore(idempotency.WithLockTimeout(lockTimeout))
	holder, err := store.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback() })
	fresh, err := holder.Mark(ctx, "billing", "evt-1")
	require.NoError(t, err)
	require.True(t, fresh)

	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := store.Mark(ctx, "billing", "evt-1")
		done <- err
	}()
	err = receive(t, done, "the waiting Mark's result")
	require.ErrorIs(t, err, idempotency.ErrMarkLocked)
	require.GreaterOrEqual(t, time.Since(start), lockTimeout, "it gave up before the lock timeout: it did not wait on the mark")
	require.Contains(t, err.Error(), `consumer "billing" event "evt-1"`)

	require.NoError(t, holder.Commit())
	fresh, err = store.Mark(ctx, "billing", "evt-1")
	require.NoError(t, err)
	require.False(t, fresh, "once the holder commits, the same Mark finds the duplicate")
}
