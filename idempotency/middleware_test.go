package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// stores runs f against each store kind.
func stores(t *testing.T, f func(t *testing.T, store idempotency.Store)) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		f(t, idempotency.NewMemoryStore())
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
			t.Parallel()
			f(t, setupPGOn(t, driver).store)
		})
	})
}

// countingHandler counts its successful runs.
func countingHandler(calls *atomic.Int64) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	}
}

func TestMiddlewareSkipsDuplicate(t *testing.T) {
	t.Parallel()
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			stores(t, func(t *testing.T, store idempotency.Store) {
				m, reg := newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode})
				var calls atomic.Int64
				h := m.Middleware(countingHandler(&calls))

				for i := range 3 {
					produced, err := h(idempotencytest.NewMessage("evt-1", nil))
					require.NoError(t, err, "delivery %d", i)
					require.Empty(t, produced)
				}
				_, err := h(idempotencytest.NewMessage("evt-2", nil))
				require.NoError(t, err)

				require.EqualValues(t, 2, calls.Load(), "handler runs once per event")
				require.EqualValues(t, 2, metric(t, reg, idempotency.MetricDuplicates, "billing"))
				require.EqualValues(t, 2, metric(t, reg, idempotency.MetricProcessed, "billing"))
				seen, err := store.Processed(bg, "billing", "evt-1")
				require.NoError(t, err)
				require.True(t, seen)
			})
		})
	}
}

func TestMiddlewareHandlerErrorRemovesMark(t *testing.T) {
	t.Parallel()
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			stores(t, func(t *testing.T, store idempotency.Store) {
				m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode})
				boom := errors.New("boom")
				var calls atomic.Int64
				fail := true
				h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					calls.Add(1)
					if fail {
						return nil, boom
					}
					return nil, nil
				})

				_, err := h(idempotencytest.NewMessage("evt-1", nil))
				require.ErrorIs(t, err, boom, "handler error reaches the router (nack)")
				seen, err := store.Processed(bg, "billing", "evt-1")
				require.NoError(t, err)
				require.False(t, seen, "no mark after a failed handler")

				fail = false
				_, err = h(idempotencytest.NewMessage("evt-1", nil))
				require.NoError(t, err)
				require.EqualValues(t, 2, calls.Load(), "redelivery runs the handler again")
			})
		})
	}
}

// A handler that writes its effect and then fails leaves neither the effect
// nor the mark.
func TestMiddlewareHandlerErrorRollsBackEffect(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testHandlerErrorRollsBackEffect(t, setupPGOn(t, driver))
	})
}

func testHandlerErrorRollsBackEffect(t *testing.T, b *pgBundle) {
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	boom := errors.New("boom")
	fail := true
	write := effectHandler("billing")
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := write(msg); err != nil {
			return nil, err
		}
		if fail {
			return nil, boom
		}
		return nil, nil
	})

	_, err := h(idempotencytest.NewMessage("evt-1", nil))
	require.ErrorIs(t, err, boom)
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`), "effect rolled back")
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`), "mark rolled back")

	fail = false
	for range 2 {
		_, err = h(idempotencytest.NewMessage("evt-1", nil))
		require.NoError(t, err)
	}
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`), "redelivery applies the effect once")
}

// A consumer that dies after its handler wrote the effect but before the
// commit (the connection drops) leaves nothing behind; one that dies after
// the commit but before the ack gets a redelivery, which is skipped.
func TestMiddlewareCrashBeforeCommitOrAckAppliesOnce(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, reg := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	write := effectHandler("billing")
	crash := true
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := write(msg); err != nil {
			return nil, err
		}
		if crash {
			crash = false
			tx, _ := idempotency.TxFromContext(msg.Context())
			var pid int
			require.NoError(t, tx.SQL().QueryRowContext(msg.Context(), `SELECT pg_backend_pid()`).Scan(&pid))
			_, err := b.schema.DB.Exec(`SELECT pg_terminate_backend($1)`, pid)
			require.NoError(t, err)
		}
		return nil, nil
	})

	_, err := h(idempotencytest.NewMessage("evt-1", nil))
	require.Error(t, err, "commit on a dead connection fails, so the message is nacked")
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))

	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err, "redelivery after the crash")
	// The ack of that delivery is lost: the broker redelivers once more.
	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err)

	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`))
	require.EqualValues(t, 1, metric(t, reg, idempotency.MetricDuplicates, "billing"))
}

func TestMiddlewareScopesByConsumer(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	for _, consumer := range []string{"billing", "shipping"} {
		m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: consumer})
		h := m.Middleware(effectHandler(consumer))
		for range 2 {
			_, err := h(idempotencytest.NewMessage("evt-1", nil))
			require.NoError(t, err)
		}
	}
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects WHERE consumer = 'billing'`))
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM effects WHERE consumer = 'shipping'`))
}

func TestMiddlewareMissingEventID(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, store idempotency.Store) {
		m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing"})
		var calls atomic.Int64
		h := m.Middleware(countingHandler(&calls))

		msg := message.NewMessage("uuid-1", nil)
		_, err := h(msg)
		require.ErrorIs(t, err, idempotency.ErrNoEventID)
		require.True(t, failure.IsPermanent(err), "retrying cannot give the message an id")
		require.Contains(t, err.Error(), "ce_id", "the error names the missing key")
		require.Contains(t, err.Error(), "billing", "the error names the consumer")
		require.Zero(t, calls.Load(), "handler not run")

		withKey, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing", KeyFunc: idempotency.KeyFromUUID})
		h = withKey.Middleware(countingHandler(&calls))
		for range 2 {
			_, err = h(message.NewMessage("uuid-1", nil))
			require.NoError(t, err)
		}
		require.EqualValues(t, 1, calls.Load(), "KeyFunc gives the fallback id")

		failingKey, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing",
			KeyFunc: func(*message.Message) (string, error) { return "", errors.New("bad payload") }})
		_, err = failingKey.Middleware(countingHandler(&calls))(message.NewMessage("uuid-2", nil))
		require.ErrorIs(t, err, idempotency.ErrNoEventID)
		require.True(t, failure.IsPermanent(err))
		require.Contains(t, err.Error(), "bad payload")
	})
}

// The middleware replaces msg's context for the handler only (Watermill #467).
func TestMiddlewareRestoresContext(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	type key struct{}
	msg := idempotencytest.NewMessage("evt-1", nil)
	orig := context.WithValue(context.Background(), key{}, "v")
	msg.SetContext(orig)

	var inside *sql.Tx
	_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		pt, ok := idempotency.TxFromContext(msg.Context())
		tx := pt.SQL()
		require.True(t, ok)
		require.Equal(t, "v", msg.Context().Value(key{}), "handler context derives from the message's")
		inside = tx
		return nil, nil
	})(msg)
	require.NoError(t, err)
	require.NotNil(t, inside)
	require.Equal(t, orig, msg.Context(), "original context restored")
	_, ok := idempotency.TxFromContext(msg.Context())
	require.False(t, ok)
}

func TestMiddlewareMarkAfterSuccessHasNoTx(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "mailer", Mode: idempotency.MarkAfterSuccess})
	ran := false
	_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, ok := idempotency.TxFromContext(msg.Context())
		require.False(t, ok, "no transaction is held while the external call runs")
		ran = true
		return nil, nil
	})(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err)
	require.True(t, ran)
	require.Equal(t, 1, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events WHERE consumer = 'mailer'`))
}

// Two deliveries of one event finishing at once in MarkAfterSuccess mode both
// run (the documented window) and the second is counted.
func TestMiddlewareMarkAfterSuccessCountsRepeatedEffect(t *testing.T) {
	t.Parallel()
	store := idempotency.NewMemoryStore()
	m, reg := newMiddleware(t, store, idempotency.Config{Consumer: "mailer", Mode: idempotency.MarkAfterSuccess})
	var calls atomic.Int64
	h := m.Middleware(countingHandler(&calls))
	inner := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		// A second delivery of the same event completes while this one runs.
		_, err := h(idempotencytest.NewMessage("evt-1", nil))
		return nil, err
	})
	_, err := inner(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.EqualValues(t, 1, metric(t, reg, idempotency.MetricRepeatedEffects, "mailer"))
}

func TestNewMiddlewareValidates(t *testing.T) {
	t.Parallel()
	_, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{})
	require.ErrorContains(t, err, "Config.Consumer is empty")
	_, err = idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "c", Mode: 7})
	require.ErrorContains(t, err, "invalid Config.Mode 7")
	err = idempotency.Config{Mode: 7}.Validate()
	require.ErrorContains(t, err, "Config.Consumer is empty")
	require.ErrorContains(t, err, "invalid Config.Mode 7", "every field error, joined")
	_, err = idempotency.NewMiddleware(nil, idempotency.Config{Consumer: "c"})
	require.ErrorContains(t, err, "store is nil")

	// Where produced messages go: one destination, a topic only with one,
	// and the outbox only on an SQL store.
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	err = idempotency.Config{Consumer: "c", ProducedToOutbox: true, ProducedPublisher: pub}.Validate()
	require.ErrorContains(t, err, "Config.ProducedToOutbox and Config.ProducedPublisher are both set")
	err = idempotency.Config{Consumer: "c", ProducedTopic: "invoices"}.Validate()
	require.ErrorContains(t, err, `Config.ProducedTopic "invoices" is set but no destination is`)
	_, err = idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "c", ProducedToOutbox: true})
	require.ErrorContains(t, err, "Config.ProducedToOutbox needs a PostgresStore")
	_, err = idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "c", ProducedPublisher: pub, ProducedTopic: "invoices"})
	require.NoError(t, err)
	_, err = idempotency.NewPostgresStore(postgres.From((*sql.DB)(nil)))
	require.ErrorContains(t, err, "db is nil")
}

// Two middlewares sharing one Registerer share the counters.
func TestMiddlewareSharedRegisterer(t *testing.T) {
	t.Parallel()
	store := idempotency.NewMemoryStore()
	a, reg := newMiddleware(t, store, idempotency.Config{Consumer: "a"})
	b, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "b", Registerer: reg})
	require.NoError(t, err)
	var calls atomic.Int64
	for _, m := range []*idempotency.Middleware{a, b} {
		for range 2 {
			_, err := m.Middleware(countingHandler(&calls))(idempotencytest.NewMessage("e", nil))
			require.NoError(t, err)
		}
	}
	require.EqualValues(t, 1, metric(t, reg, idempotency.MetricDuplicates, "a"))
	require.EqualValues(t, 1, metric(t, reg, idempotency.MetricDuplicates, "b"))
}

func TestPostgresStoreRejectsNULInID(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	var calls atomic.Int64
	_, err := m.Middleware(countingHandler(&calls))(idempotencytest.NewMessage("evt\x00-1", nil))
	require.ErrorIs(t, err, idempotency.ErrNoEventID)
	require.True(t, failure.IsPermanent(err), "retrying cannot fix the id")
	require.Zero(t, calls.Load())
}

func TestPostgresStoreNamesMissingMigration(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t) // no migrations
	store, err := idempotency.NewPostgresStore(postgres.From(s.DB))
	require.NoError(t, err)
	m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing"})
	var calls atomic.Int64
	_, err = m.Middleware(countingHandler(&calls))(idempotencytest.NewMessage("evt-1", nil))
	require.ErrorContains(t, err, "millwright migrate")
	require.Zero(t, calls.Load())
}
