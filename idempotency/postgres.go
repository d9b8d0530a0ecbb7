package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// PostgresStore keeps marks in the millwright_processed_events table (see
// Migrations). Its units of work are READ COMMITTED database transactions:
// at that level a second INSERT of the same key waits for the first
// transaction and then sees the conflict, which is what makes concurrent
// duplicates safe. (At REPEATABLE READ or SERIALIZABLE the second would fail
// with a serialization error instead.)
type PostgresStore struct {
	db *sql.DB
}

// NewPostgresStore returns a store on db. The table must exist: apply
// Migrations() with migrate.Up or `millwright migrate` first. The pool needs
// one connection per message being handled at once.
func NewPostgresStore(db *sql.DB) (*PostgresStore, error) {
	if db == nil {
		return nil, errors.New("idempotency: NewPostgresStore: db is nil; pass an open *sql.DB (lib/pq)")
	}
	return &PostgresStore{db: db}, nil
}

// Begin starts a READ COMMITTED transaction.
func (s *PostgresStore) Begin(ctx context.Context) (Tx, error) {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("idempotency: begin transaction: %w", err)
	}
	return &pgTx{tx: tx}, nil
}

// Processed reports whether a committed mark exists.
func (s *PostgresStore) Processed(ctx context.Context, consumer, eventID string) (bool, error) {
	var found bool
	err := s.db.QueryRowContext(ctx,
		`SELECT EXISTS (SELECT 1 FROM millwright_processed_events WHERE consumer = $1 AND event_id = $2)`,
		consumer, eventID).Scan(&found)
	if err != nil {
		return false, fmt.Errorf("idempotency: reading mark of consumer %q event %q: %w", consumer, eventID, err)
	}
	return found, nil
}

type pgTx struct {
	tx *sql.Tx
}

func (t *pgTx) SQLTx() *sql.Tx { return t.tx }

func (t *pgTx) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	res, err := t.tx.ExecContext(ctx,
		`INSERT INTO millwright_processed_events (consumer, event_id) VALUES ($1, $2)
		 ON CONFLICT (consumer, event_id) DO NOTHING`,
		consumer, eventID)
	if err != nil {
		return false, fmt.Errorf("idempotency: marking consumer %q event %q (did you run the idempotency migrations?): %w",
			consumer, eventID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("idempotency: marking consumer %q event %q: %w", consumer, eventID, err)
	}
	return n == 1, nil
}

func (t *pgTx) Commit() error {
	if err := t.tx.Commit(); err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	return nil
}

func (t *pgTx) Rollback() error {
	err := t.tx.Rollback()
	if err != nil && !errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("idempotency: rollback: %w", err)
	}
	return nil
}
