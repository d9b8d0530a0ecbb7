package idempotency_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

// pgBundle is a fresh schema with the idempotency table and an effects table
// for handlers to write to. effects has no unique key, so a double effect
// shows as two rows.
type pgBundle struct {
	schema *pgtest.Schema
	store  *idempotency.PostgresStore
}

func setupPG(t *testing.T) *pgBundle { return setupPGOn(t, pgtest.DriverPQ) }

// setupPGOn is setupPG with the store on driver (pgtest.DriverPQ or
// pgtest.DriverPgx).
func setupPGOn(t *testing.T, driver string, sources ...migrate.Source) *pgBundle {
	t.Helper()
	s := pgtest.New(t, append([]migrate.Source{idempotency.Migrations()}, sources...)...)
	_, err := s.DB.Exec(`CREATE TABLE effects (consumer TEXT NOT NULL, event_id TEXT NOT NULL)`)
	require.NoError(t, err)
	return &pgBundle{schema: s, store: storeOn(t, s, driver)}
}

// storeOn returns a store on s for driver: on pq, a pool of millwright's
// own connections (the mark travels with BEGIN; the store suite covers
// plain lib/pq pools too); on pgx, a pgxpool.
func storeOn(t *testing.T, s *pgtest.Schema, driver string, opts ...idempotency.StoreOption) *idempotency.PostgresStore {
	t.Helper()
	var (
		store *idempotency.PostgresStore
		err   error
	)
	switch driver {
	case pgtest.DriverPQ:
		store, err = idempotency.NewPostgresStore(postgres.From(pgconnPool(t, s)), opts...)
	case pgtest.DriverPgx:
		store, err = idempotency.NewPostgresStore(postgres.From(s.Pgx(t)), opts...)
	default:
		t.Fatalf("unknown driver %q", driver)
	}
	require.NoError(t, err)
	return store
}

// handlerTx returns the middleware's transaction, on either driver.
func handlerTx(ctx context.Context) (storage.Querier, bool) {
	if pt, ok := idempotency.TxFromContext(ctx); ok && pt.SQL() != nil {
		tx := pt.SQL()
		return storage.NewSQL(tx), true
	}
	if pt, ok := idempotency.TxFromContext(ctx); ok && pt.Pgx() != nil {
		tx := pt.Pgx()
		return storage.NewPgx(tx), true
	}
	return nil, false
}

// effectHandler writes one effects row in the middleware's transaction.
func effectHandler(consumer string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := handlerTx(msg.Context())
		if !ok {
			return nil, errNoTx
		}
		_, err := tx.Exec(msg.Context(), storage.S(`INSERT INTO effects (consumer, event_id) VALUES ($1, $2)`,
			consumer, msg.Metadata.Get("ce_id")))
		return nil, err
	}
}

type testError string

func (e testError) Error() string { return string(e) }

const errNoTx = testError("handler ran without the middleware's transaction")

func countRows(t *testing.T, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(query, args...).Scan(&n))
	return n
}

func newMiddleware(t *testing.T, store idempotency.Store, cfg idempotency.Config) (*idempotency.Middleware, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	if cfg.Registerer == nil {
		cfg.Registerer = reg
	}
	m, err := idempotency.NewMiddleware(store, cfg)
	require.NoError(t, err)
	return m, reg
}

// metric returns the value of counter name for consumer in reg (0 if absent).
func metric(t *testing.T, reg prometheus.Gatherer, name, consumer string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer" && l.GetValue() == consumer {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// eventually polls cond until it holds or 10 s pass: for state that
// another connection or goroutine changes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, 10*time.Second, cond, "%s", what)
}

var bg = context.Background()
