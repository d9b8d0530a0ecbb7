package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/lib/pq"

	"github.com/millwright/millwright/retry"
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
	if err := checkKey(consumer, eventID); err != nil {
		return false, err
	}
	var found bool
	err := s.db.QueryRowContext(ctx,
		`SELECT EXISTS (SELECT 1 FROM millwright_processed_events WHERE consumer = `+pq.QuoteLiteral(consumer)+
			` AND event_id = `+pq.QuoteLiteral(eventID)+`)`).Scan(&found)
	if err != nil {
		return false, fmt.Errorf("idempotency: reading mark of consumer %q event %q%s: %w", consumer, eventID, migrationHint(err), err)
	}
	return found, nil
}

// migrationHint suggests the fix when the table is missing.
func migrationHint(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && pqErr.Code == "42P01" { // undefined_table
		return " (table missing: run `millwright migrate` or migrate.Up with idempotency.Migrations())"
	}
	return ""
}

// checkKey rejects what a Postgres TEXT cannot hold, so that such a message
// fails permanently instead of being retried against a database error.
func checkKey(consumer, eventID string) error {
	if strings.IndexByte(consumer, 0) >= 0 || strings.IndexByte(eventID, 0) >= 0 || !utf8.ValidString(consumer) || !utf8.ValidString(eventID) {
		return retry.Permanent(fmt.Errorf("idempotency: consumer %q event %q: %w: ids must be valid UTF-8 without NUL bytes", consumer, eventID, ErrNoEventID))
	}
	return nil
}

// The statements inline the ids as quoted literals (pq.QuoteLiteral, the
// libpq escaping algorithm) instead of $n parameters: lib/pq sends a
// statement without parameters in one round trip and a parameterised one in
// two, and the mark is on every message's path. Measured with `millwright
// bench idempotency`.

// Mark writes one mark in an autocommit statement (Marker).
func (s *PostgresStore) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	return mark(ctx, s.db, consumer, eventID)
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

type pgTx struct {
	tx *sql.Tx
}

func (t *pgTx) SQLTx() *sql.Tx { return t.tx }

func (t *pgTx) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	return mark(ctx, t.tx, consumer, eventID)
}

func mark(ctx context.Context, db execer, consumer, eventID string) (bool, error) {
	if err := checkKey(consumer, eventID); err != nil {
		return false, err
	}
	res, err := db.ExecContext(ctx,
		`INSERT INTO millwright_processed_events (consumer, event_id) VALUES (`+
			pq.QuoteLiteral(consumer)+`, `+pq.QuoteLiteral(eventID)+`) ON CONFLICT (consumer, event_id) DO NOTHING`)
	if err != nil {
		return false, fmt.Errorf("idempotency: marking consumer %q event %q%s: %w",
			consumer, eventID, migrationHint(err), err)
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
