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
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/internal/poll"
)

// pgBundle is a fresh schema with the idempotency table and an effects table
// for handlers to write to. effects has no unique key, so a double effect
// shows as two rows.
type pgBundle struct {
	schema *pgtest.Schema
	store  *idempotency.PostgresStore
}

func setupPG(t *testing.T) *pgBundle {
	t.Helper()
	s := pgtest.New(t, idempotency.Migrations())
	_, err := s.DB.Exec(`CREATE TABLE effects (consumer TEXT NOT NULL, event_id TEXT NOT NULL)`)
	require.NoError(t, err)
	// The store's pool is one of millwright's own connections (the mark
	// travels with BEGIN); the store suite covers plain lib/pq pools too.
	store, err := idempotency.NewPostgresStore(pgconnPool(t, s))
	require.NoError(t, err)
	return &pgBundle{schema: s, store: store}
}

// effectHandler writes one effects row in the middleware's transaction.
func effectHandler(consumer string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := idempotency.TxFromContext(msg.Context())
		if !ok {
			return nil, errNoTx
		}
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO effects (consumer, event_id) VALUES ($1, $2)`,
			consumer, msg.Metadata.Get("ce_id"))
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
