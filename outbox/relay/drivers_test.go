package relay

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// The tests of this file run on each driver of the matrix
// (pgtest.ForEachDriver): the relay on a *sql.DB (lib/pq) and on a
// *pgxpool.Pool, and the user's transaction a *sql.Tx or a pgx.Tx.

// driverBundle is setup's bundle with the pool of one driver: handle is a
// *sql.DB (pgconn.Open's, as postgres.Open gives users) or a
// *pgxpool.Pool.
type driverBundle struct {
	bundle
	handle any
	pdb    postgres.DB // handle's DB
}

func setupDriver(t *testing.T, driver string) driverBundle {
	t.Helper()
	b := setup(t)
	var h any = b.db
	if driver == pgtest.DriverPgx {
		h = b.schema.Pgx(t)
	}
	pdb := postgres.SQL(b.db)
	if p, ok := h.(*pgxpool.Pool); ok {
		pdb = postgres.Pgx(p)
	}
	return driverBundle{bundle: b, handle: h, pdb: pdb}
}

// newRelayOn is New on a handle of either driver.
func newRelayOn(h any, pub message.Publisher, cfg Config) (*Relay, error) {
	switch db := h.(type) {
	case *sql.DB:
		return New(postgres.From(db), pub, cfg)
	case *pgxpool.Pool:
		return New(postgres.From(db), pub, cfg)
	}
	return nil, fmt.Errorf("no relay on a %T", h)
}

func startRelayOn(t *testing.T, h any, pub message.Publisher, cfg Config) *Relay {
	t.Helper()
	r, err := newRelayOn(h, pub, cfg)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-errc)
	})
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("relay not running after 10s")
	}
	return r
}

// userTx is a user's transaction on either driver.
type userTx struct {
	tx       postgres.Tx // what the user passes to Add
	exec     func(q string) error
	pid      func() int
	commit   func() error
	rollback func() error
}

func begin(t *testing.T, h any) userTx {
	t.Helper()
	ctx := context.Background()
	switch db := h.(type) {
	case *sql.DB:
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback() })
		return userTx{tx: postgres.SQLTx(tx),
			exec: func(q string) error { _, err := tx.ExecContext(ctx, q); return err },
			pid: func() int {
				var pid int
				require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
				return pid
			},
			commit: tx.Commit, rollback: tx.Rollback}
	case *pgxpool.Pool:
		tx, err := db.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return userTx{tx: postgres.PgxTx(tx),
			exec: func(q string) error { _, err := tx.Exec(ctx, q); return err },
			pid: func() int {
				var pid int
				require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
				return pid
			},
			commit: func() error { return tx.Commit(ctx) }, rollback: func() error { return tx.Rollback(ctx) }}
	}
	t.Fatalf("no transaction on a %T", h)
	return userTx{}
}

// A user's transaction, a *sql.Tx or a pgx.Tx (from pgxpool), carries the
// event: the business row and the event commit together and roll back
// together.
func TestDrivers_UserTxCarriesTheEvent(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		ctx := context.Background()
		_, err := b.schema.DB.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`)
		require.NoError(t, err)

		tx := begin(t, b.handle)
		require.NoError(t, tx.exec(`INSERT INTO orders VALUES ('o-1')`))
		require.NoError(t, outbox.Add(ctx, tx.tx, outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{"n":1}`)}))
		require.Equal(t, 0, count(t, b.schema.DB, "aggregate_id = 'o-1'"), "nothing visible before COMMIT")
		require.NoError(t, tx.commit())
		require.Equal(t, 1, countOrders(t, b.schema.DB))
		require.Equal(t, 1, count(t, b.schema.DB, "aggregate_id = 'o-1' AND status = 'pending'"))

		tx = begin(t, b.handle)
		require.NoError(t, tx.exec(`INSERT INTO orders VALUES ('o-2')`))
		require.NoError(t, outbox.Add(ctx, tx.tx, outbox.Event{Topic: "orders", AggregateID: "o-2", Payload: []byte(`{"n":2}`)}))
		require.NoError(t, tx.rollback())
		require.Equal(t, 1, countOrders(t, b.schema.DB), "the business row rolled back")
		require.Equal(t, 0, count(t, b.schema.DB, "aggregate_id = 'o-2'"), "the event rolled back with it")
	})
}

// TxPublisher writes through a user's transaction of either driver, and
// the relay on that driver's pool publishes what committed.
func TestDrivers_TxPublisher(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		got := b.collect(t, "orders")
		tx := begin(t, b.handle)
		pub, err := outbox.NewTxPublisher(tx.tx, outbox.PublisherConfig{Source: "svc"})
		require.NoError(t, err)
		wm := message.NewMessage("ev-1", []byte(`{"total": 10}`))
		wm.Metadata.Set(metadata.AggregateID, "o1")
		wm.Metadata.Set(metadata.AggregateType, "order")
		wm.Metadata.Set("custom", "yes")
		require.NoError(t, pub.Publish("orders", wm))
		require.NoError(t, tx.commit())
		rolled := begin(t, b.handle)
		pub, err = outbox.NewTxPublisher(rolled.tx, outbox.PublisherConfig{})
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", message.NewMessage("ev-rolled-back", []byte(`{}`))))
		require.NoError(t, rolled.rollback())

		startRelayOn(t, b.handle, b.pubsub, Config{ListenURL: b.schema.URL})
		eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "want 1 message")
		m := got.all()[0]
		require.Equal(t, "ev-1", m.UUID)
		require.JSONEq(t, `{"total": 10}`, string(m.Payload))
		require.Equal(t, "order/o1", m.Metadata.Get(metadata.OrderingKey))
		require.Equal(t, "yes", m.Metadata.Get("custom"))
		require.Equal(t, "svc", m.Metadata.Get(metadata.EventSource))
		eventually(t, 30*time.Second, func() bool { return count(t, b.schema.DB, "status = 'published'") == 1 }, "row marked published")
		require.Equal(t, 1, count(t, b.schema.DB, "true"), "the rolled back event was never written")
	})
}

// With ListenURL the relay listens on its pool's driver (pgx: its own
// pgx.Conn in WaitForNotification): a poll interval far beyond the
// deadline, only the notification can deliver.
func TestDrivers_ListenWakesWithoutPolling(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		got := b.collect(t, "t")
		// Lease 3m: the idle relay's own wake-up (a third of the lease) is
		// 60 s away, beyond the 30 s waits below.
		r := startRelayOn(t, b.handle, b.pubsub, Config{ListenURL: b.schema.URL, PollInterval: time.Hour, Lease: 3 * time.Minute})
		require.Equal(t, b.handle == any(b.db), r.db.Driver() == "database/sql")
		for i := range 3 {
			require.NoError(t, outbox.AddOutsideTx(context.Background(), b.pdb, outbox.Event{Topic: "t", AggregateID: "a"}))
			eventually(t, 30*time.Second, func() bool { return len(got.all()) == i+1 }, "NOTIFY should wake the relay")
		}
	})
}

// Two relays on one driver's pool drain a backlog written by concurrent
// users' transactions of that driver, every aggregate in order, while
// publishes fail now and then (the failures' record and backoff, on that
// driver too).
func TestDrivers_RelaysDrainInOrder(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		got := b.collect(t, "t")
		var calls, hiccups atomic.Int64
		var failed sync.Map
		pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
			if calls.Add(1)%17 == 0 {
				if _, again := failed.LoadOrStore(m.UUID, true); !again {
					hiccups.Add(1)
					return errors.New("broker hiccup")
				}
			}
			return nil
		}}
		cfg := Config{BatchSize: 50, PollInterval: 5 * time.Millisecond, ListenURL: b.schema.URL,
			Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxAttempts: -1}}
		for range 2 {
			startRelayOn(t, b.handle, pub, cfg)
		}
		const aggregates, perAggregate, writers = 8, 30, 4
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for seq := 1; seq <= perAggregate; seq++ {
					for a := w; a < aggregates; a += writers {
						tx := begin(t, b.handle)
						if err := outbox.Add(context.Background(), tx.tx, outbox.Event{Topic: "t", AggregateType: "acct", AggregateID: fmt.Sprint("a", a),
							Payload: []byte(strconv.Itoa(seq))}); err != nil {
							t.Error(err)
							return
						}
						if err := tx.commit(); err != nil {
							t.Error(err)
							return
						}
					}
				}
			}()
		}
		wg.Wait()
		eventually(t, 30*time.Second, func() bool {
			s, err := outbox.ReadStats(context.Background(), b.pdb)
			require.NoError(t, err)
			return s.Pending == 0
		}, "drain")
		checkOrder(t, got.all(), aggregates, perAggregate)
		require.Equal(t, 0, count(t, b.schema.DB, "status = 'failed'"))
		require.Positive(t, hiccups.Load(), "no publish failed: the test did not exercise failures")
	})
}

// A server-side error of Add's INSERT (here: a schema without the outbox
// table) is Add's own error, on every pool and driver (postgres.Open's,
// lib/pq's own, pgx), naming the outbox and the fix; the transaction is
// then aborted and nothing of it commits.
func TestAdd_InsertErrorIsAddsOwn(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t) // no migrations
	_, err := s.DB.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`)
	require.NoError(t, err)
	opened, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = opened.Close() })
	pools := map[string]any{"postgres.Open": opened, "pq": s.DB, "pgx": s.Pgx(t)}
	for name, h := range pools {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			tx := begin(t, h)
			require.NoError(t, tx.exec(`INSERT INTO orders VALUES ('o-1')`))
			err := outbox.Add(ctx, tx.tx, outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{}`)})
			require.ErrorContains(t, err, "millwright_outbox")
			require.ErrorContains(t, err, "did `millwright migrate` run?")
			require.Error(t, tx.commit(), "the transaction is aborted")
			require.Equal(t, 0, countOrders(t, s.DB), "nothing committed")
		})
	}
}

// Add's INSERT reaches the server before Add returns, on every pool and
// driver: nothing waits for the transaction's next statement or COMMIT.
func TestAdd_InsertIsSentByAdd(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pools := map[string]any{"postgres.Open": b.db, "pq": b.schema.DB, "pgx": b.schema.Pgx(t)}
	n := 0
	for name, h := range pools {
		n++
		t.Run(name, func(t *testing.T) {
			tx := begin(t, h)
			pid := tx.pid()
			id := "o-" + watermill.NewShortUUID()
			require.NoError(t, outbox.Add(context.Background(), tx.tx, outbox.Event{Topic: "orders", AggregateID: id, Payload: []byte(`{}`)}))
			q := pgtest.LastQuery(t, b.schema.DB, pid)
			require.True(t, strings.HasPrefix(q, "INSERT INTO millwright_outbox "), "the last statement of the transaction's session is the event's INSERT: %q", q)
			require.NoError(t, tx.commit())
			require.Equal(t, 1, count(t, b.schema.DB, "aggregate_id = '"+id+"'"))
		})
	}
	require.Equal(t, n, count(t, b.schema.DB, "true"))
}
