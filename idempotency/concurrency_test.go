package idempotency_test

import (
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// Two subscriber instances (separate pools, so separate connections) get the
// same event at once. The first holds its mark uncommitted inside the
// handler; the second's INSERT must wait on the unique index, then see the
// conflict once the first commits: one effect.
func TestMiddlewareConcurrentDuplicatesAcrossInstances(t *testing.T) {
	t.Parallel()
	b := setupPG(t)

	openInstance := func() *sql.DB {
		db, err := sql.Open("postgres", b.schema.URL)
		require.NoError(t, err)
		db.SetMaxOpenConns(1) // one connection: its backend pid identifies the instance's session
		t.Cleanup(func() { db.Close() })
		return db
	}
	dbA, dbB := openInstance(), openInstance()
	var pidB int
	require.NoError(t, dbB.QueryRow(`SELECT pg_backend_pid()`).Scan(&pidB))

	storeA, err := idempotency.NewPostgresStore(postgres.From(dbA))
	require.NoError(t, err)
	storeB, err := idempotency.NewPostgresStore(postgres.From(dbB))
	require.NoError(t, err)
	mA, regA := newMiddleware(t, storeA, idempotency.Config{Consumer: "billing"})
	mB, regB := newMiddleware(t, storeB, idempotency.Config{Consumer: "billing"})

	var runs atomic.Int64
	inHandler := make(chan struct{})
	release := make(chan struct{})
	write := effectHandler("billing")
	hA := mA.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if _, err := write(msg); err != nil {
			return nil, err
		}
		close(inHandler)
		<-release
		return nil, nil
	})
	hB := mB.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return write(msg)
	})

	errA := make(chan error, 1)
	go func() {
		_, err := hA(idempotencytest.NewMessage("evt-1", nil))
		errA <- err
	}()
	receive(t, inHandler, "instance A in its handler") // A's mark and effect are written, not committed

	errB := make(chan error, 1)
	go func() {
		_, err := hB(idempotencytest.NewMessage("evt-1", nil))
		errB <- err
	}()
	eventually(t, "instance B waits on A's row lock", func() bool {
		return pgtest.WaitingOnLock(t, b.schema.DB, pidB) == 1
	})
	select {
	case err := <-errB:
		t.Fatalf("instance B finished while A's mark was uncommitted: %v", err)
	default:
	}

	close(release)
	require.NoError(t, receive(t, errA, "instance A's result"))
	require.NoError(t, receive(t, errB, "instance B's result"), "B acks the duplicate")

	require.EqualValues(t, 1, runs.Load(), "handler ran once")
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`), "one effect")
	require.EqualValues(t, 1, metric(t, regA, idempotency.MetricProcessed, "billing"))
	require.EqualValues(t, 1, metric(t, regB, idempotency.MetricDuplicates, "billing"))
}

// The same race when the first delivery fails: the second, already waiting
// on the first's uncommitted mark, takes over and applies the effect.
func TestMiddlewareConcurrentDuplicateTakesOverAfterFailure(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	dbB, err := sql.Open("postgres", b.schema.URL)
	require.NoError(t, err)
	dbB.SetMaxOpenConns(1) // one connection: its backend pid identifies B's session
	t.Cleanup(func() { dbB.Close() })
	var pidB int
	require.NoError(t, dbB.QueryRow(`SELECT pg_backend_pid()`).Scan(&pidB))
	storeB, err := idempotency.NewPostgresStore(postgres.From(dbB))
	require.NoError(t, err)
	mA, regA := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	mB, regB := newMiddleware(t, storeB, idempotency.Config{Consumer: "billing"})

	inHandler := make(chan struct{})
	release := make(chan struct{})
	write := effectHandler("billing")
	hA := mA.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := write(msg); err != nil {
			return nil, err
		}
		close(inHandler)
		<-release
		return nil, testError("downstream refused")
	})
	var runsB atomic.Int64
	hB := mB.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runsB.Add(1)
		return write(msg)
	})

	errA := make(chan error, 1)
	go func() {
		_, err := hA(idempotencytest.NewMessage("evt-1", nil))
		errA <- err
	}()
	receive(t, inHandler, "instance A in its handler") // A's mark and effect are written, not committed
	errB := make(chan error, 1)
	go func() {
		_, err := hB(idempotencytest.NewMessage("evt-1", nil))
		errB <- err
	}()
	eventually(t, "instance B waits on A's row lock", func() bool {
		return pgtest.WaitingOnLock(t, b.schema.DB, pidB) == 1
	})
	select {
	case err := <-errB:
		t.Fatalf("instance B finished while A's mark was uncommitted: %v", err)
	default:
	}

	close(release) // A fails and rolls back; B's waiting INSERT now succeeds
	require.Error(t, receive(t, errA, "instance A's result"))
	require.NoError(t, receive(t, errB, "instance B's result"))
	require.EqualValues(t, 1, runsB.Load(), "B took over: its handler ran")
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
	require.EqualValues(t, 0, metric(t, regA, idempotency.MetricProcessed, "billing"))
	require.EqualValues(t, 1, metric(t, regB, idempotency.MetricProcessed, "billing"))
	require.EqualValues(t, 0, metric(t, regB, idempotency.MetricDuplicates, "billing"))
}

// receive returns the next value from ch, failing the test if none comes
// within 10 s.
func receive[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out after 10s waiting for %s", what)
		panic("unreachable")
	}
}
