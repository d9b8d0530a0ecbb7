package idempotency_test

import (
	"database/sql"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
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

	storeA, err := idempotency.NewPostgresStore(dbA)
	require.NoError(t, err)
	storeB, err := idempotency.NewPostgresStore(dbB)
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
	<-inHandler // A's mark and effect are written, not committed

	errB := make(chan error, 1)
	go func() {
		_, err := hB(idempotencytest.NewMessage("evt-1", nil))
		errB <- err
	}()
	eventually(t, "instance B waits on A's row lock", func() bool {
		var waiting string
		_ = b.schema.DB.QueryRow(`SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1`, pidB).Scan(&waiting)
		return waiting == "Lock"
	})
	select {
	case err := <-errB:
		t.Fatalf("instance B finished while A's mark was uncommitted: %v", err)
	default:
	}

	close(release)
	require.NoError(t, <-errA)
	require.NoError(t, <-errB, "B acks the duplicate")

	require.EqualValues(t, 1, runs.Load(), "handler ran once")
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`), "one effect")
	require.EqualValues(t, 1, metric(t, regA, idempotency.MetricProcessed, "billing"))
	require.EqualValues(t, 1, metric(t, regB, idempotency.MetricDuplicates, "billing"))
}

// The same race when the first delivery fails: the second takes over and
// applies the effect.
func TestMiddlewareConcurrentDuplicateTakesOverAfterFailure(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	storeB := func() *idempotency.PostgresStore {
		db, err := sql.Open("postgres", b.schema.URL)
		require.NoError(t, err)
		db.SetMaxOpenConns(1)
		t.Cleanup(func() { db.Close() })
		s, err := idempotency.NewPostgresStore(db)
		require.NoError(t, err)
		return s
	}()
	mA, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	mB, _ := newMiddleware(t, storeB, idempotency.Config{Consumer: "billing"})

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
	hB := mB.Middleware(write)

	errA := make(chan error, 1)
	go func() {
		_, err := hA(idempotencytest.NewMessage("evt-1", nil))
		errA <- err
	}()
	<-inHandler
	errB := make(chan error, 1)
	go func() {
		_, err := hB(idempotencytest.NewMessage("evt-1", nil))
		errB <- err
	}()
	close(release) // B may or may not have reached the lock yet; both orders must give one effect
	require.Error(t, <-errA)
	require.NoError(t, <-errB)
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
}
