package main

import (
	"context"
	"database/sql"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// sqlService is the quickstart's service on database/sql with lib/pq
// (-driver pq): millwright's components run on a *sql.DB, and the business
// transaction and the handler's are *sql.Tx.
type sqlService struct{ db *sql.DB }

// placeOrder writes the order and its event in one transaction. outbox.Add
// returns the event INSERT's error itself.
func (s sqlService) placeOrder(ctx context.Context, id string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	if _, err := tx.ExecContext(ctx, `INSERT INTO quickstart_orders (id) VALUES ($1)`, id); err != nil {
		return err
	}
	if err := outbox.Add(ctx, postgres.SQLTx(tx), orderCreated(id)); err != nil {
		return err
	}
	return tx.Commit()
}

// notify applies the event's effect in the idempotency middleware's
// transaction, a *sql.Tx: it commits with the processed mark.
func (s sqlService) notify(msg *message.Message) error {
	pt, ok := idempotency.TxFromContext(msg.Context())
	tx := pt.SQL()
	if !ok {
		return retry.Permanent(errors.New("notify: no idempotency *sql.Tx in the message context"))
	}
	_, err := tx.ExecContext(msg.Context(), `INSERT INTO quickstart_notifications (order_id) VALUES ($1)`, string(msg.Payload))
	return err
}

func (s sqlService) idempotencyStore() (*idempotency.PostgresStore, error) {
	return idempotency.NewPostgresStore(postgres.From(s.db))
}

func (s sqlService) relay(pub message.Publisher, cfg outbox.RelayConfig) (*outbox.Relay, error) {
	return outbox.NewRelay(postgres.From(s.db), pub, cfg)
}

func (s sqlService) close() {} // the *sql.DB is main's
