package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// pgxService is the quickstart's service on pgx v5 (-driver pgx, the
// default): millwright's components run on a *pgxpool.Pool, and the
// business transaction and the handler's are pgx.Tx.
type pgxService struct{ pool *pgxpool.Pool }

func openPgx(ctx context.Context, dbURL string) (pgxService, error) {
	// Bounded like postgres.Open; pool_max_conns in the URL sets its size.
	pool, err := postgres.OpenPgx(ctx, dbURL)
	return pgxService{pool}, err
}

// placeOrder writes the order and its event in one transaction. The
// order's INSERT and the event's go in one pgx.Batch: one round trip. An
// error of either comes back from the batch's results (Close).
func (s pgxService) placeOrder(ctx context.Context, id string) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO quickstart_orders (id) VALUES ($1)`, id)
	if err := outbox.AddToBatch(ctx, b, orderCreated(id)); err != nil {
		return err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("placing order %s: %w", id, err)
	}
	return tx.Commit(ctx)
}

// notify applies the event's effect in the idempotency middleware's
// transaction, a pgx.Tx: it commits with the processed mark.
func (s pgxService) notify(msg *message.Message) error {
	pt, ok := idempotency.TxFromContext(msg.Context())
	tx := pt.Pgx()
	if !ok {
		return retry.Permanent(errors.New("notify: no idempotency pgx.Tx in the message context"))
	}
	_, err := tx.Exec(msg.Context(), `INSERT INTO quickstart_notifications (order_id) VALUES ($1)`, string(msg.Payload))
	return err
}

func (s pgxService) idempotencyStore() (*idempotency.PostgresStore, error) {
	return idempotency.NewPostgresStore(postgres.From(s.pool))
}

func (s pgxService) relay(pub message.Publisher, cfg outbox.RelayConfig) (*outbox.Relay, error) {
	return outbox.NewRelay(postgres.From(s.pool), pub, cfg)
}

func (s pgxService) close() { s.pool.Close() }
