package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"

	"github.com/millwright/millwright/internal/pgconn"
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
	// markSQLPrefix sets the statement's lock_timeout; "" when unbounded.
	markSQLPrefix string
	lockTimeout   time.Duration
}

// DefaultLockTimeout is how long Mark waits, by default, for another unit
// of work's uncommitted mark of the same event (a concurrent duplicate
// being handled elsewhere) before it gives up.
const DefaultLockTimeout = 30 * time.Second

// StoreOption configures a PostgresStore or a MemoryStore.
type StoreOption func(*storeOptions)

type storeOptions struct {
	lockTimeout time.Duration
}

func applyOptions(opts []StoreOption) storeOptions {
	o := storeOptions{lockTimeout: DefaultLockTimeout}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithLockTimeout sets how long Mark waits for another unit of work's
// uncommitted mark of the same event. Default DefaultLockTimeout; a
// negative value waits as long as the context allows. Past it, Mark fails
// with ErrMarkLocked, a transient error: the message is retried, and by
// then the other unit of work has committed (a duplicate, skipped) or
// rolled back (this one takes over).
//
// On the Postgres store the bound is set with SET LOCAL lock_timeout in
// the same round trip as the mark, so it also applies to the rest of the
// unit of work's transaction (the handler's effects): set it to what a
// handler's statement may wait on a lock.
func WithLockTimeout(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.lockTimeout = d }
}

// ErrMarkLocked is returned (wrapped) by Mark, of either store, when
// another unit of work held an uncommitted mark of the same event for
// longer than the lock timeout (WithLockTimeout).
var ErrMarkLocked = errors.New("idempotency: another unit of work holds an uncommitted mark of this event")

// NewPostgresStore returns a store on db. The table must exist: apply
// Migrations() with migrate.Up or `millwright migrate` first. The pool needs
// one connection per message being handled at once.
func NewPostgresStore(db *sql.DB, opts ...StoreOption) (*PostgresStore, error) {
	if db == nil {
		return nil, errors.New("idempotency: NewPostgresStore: db is nil; pass an open *sql.DB (lib/pq)")
	}
	s := &PostgresStore{db: db, lockTimeout: applyOptions(opts).lockTimeout}
	if s.lockTimeout >= 0 {
		ms := max(s.lockTimeout.Milliseconds(), 1) // 0 would mean no timeout to Postgres
		// SET LOCAL, not SELECT set_config(..., true): the same setting,
		// but a utility statement skips the planner and executor, which
		// showed in the mark's cost.
		s.markSQLPrefix = fmt.Sprintf("SET LOCAL lock_timeout = %d; ", ms)
	}
	return s, nil
}

// Begin starts a READ COMMITTED transaction.
func (s *PostgresStore) Begin(ctx context.Context) (Tx, error) {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("idempotency: begin transaction: %w", err)
	}
	return &pgTx{tx: tx, store: s}, nil
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
	return s.mark(ctx, s.db, consumer, eventID)
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

type pgTx struct {
	tx    *sql.Tx
	store *PostgresStore
}

func (t *pgTx) SQLTx() *sql.Tx { return t.tx }

func (t *pgTx) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	return t.store.mark(ctx, t.tx, consumer, eventID)
}

// mark inserts the mark. A concurrent unit of work holding an uncommitted
// mark of the same key makes the INSERT wait for its end; lock_timeout
// bounds that wait even when a cancellation of ctx is lost (lib/pq's
// cancel request can reach the server before the statement does, and the
// server then ignores it).
func (s *PostgresStore) mark(ctx context.Context, db execer, consumer, eventID string) (bool, error) {
	if err := checkKey(consumer, eventID); err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("idempotency: marking consumer %q event %q: %w", consumer, eventID, err)
	}
	// One round trip: lib/pq sends a statement without parameters as a
	// simple query, and Exec reports the last statement's row count.
	res, err := db.ExecContext(ctx, s.markSQL(consumer, eventID))
	if err != nil {
		return false, s.markError(ctx, consumer, eventID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("idempotency: marking consumer %q event %q: %w", consumer, eventID, err)
	}
	return n == 1, nil
}

// markSQL is the mark of (consumer, eventID): its lock_timeout, then the
// INSERT, whose row count says whether it wrote the mark.
func (s *PostgresStore) markSQL(consumer, eventID string) string {
	return s.markSQLPrefix + `INSERT INTO millwright_processed_events (consumer, event_id) VALUES (` +
		pq.QuoteLiteral(consumer) + `, ` + pq.QuoteLiteral(eventID) + `) ON CONFLICT (consumer, event_id) DO NOTHING`
}

// markError says why the mark of (consumer, eventID) failed.
func (s *PostgresStore) markError(ctx context.Context, consumer, eventID string, err error) error {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && pqErr.Code == "55P03" { // lock_not_available
		return fmt.Errorf("idempotency: marking consumer %q event %q: waited %s (lock timeout): %w (%v)",
			consumer, eventID, s.lockTimeout, ErrMarkLocked, err)
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("idempotency: marking consumer %q event %q: %w (%v)", consumer, eventID, ctxErr, err)
	}
	return fmt.Errorf("idempotency: marking consumer %q event %q%s: %w",
		consumer, eventID, migrationHint(err), err)
}

// BeginMark begins a unit of work and writes the mark of (consumer,
// eventID) in it, as Begin then Tx.Mark would. On a pool of
// postgres.Open the mark travels with BEGIN, one round trip instead of
// two; on any other pool it is Begin then Mark.
func (s *PostgresStore) BeginMark(ctx context.Context, consumer, eventID string) (Tx, bool, error) {
	if err := checkKey(consumer, eventID); err != nil {
		return nil, false, err
	}
	if err := ctx.Err(); err != nil {
		return nil, false, fmt.Errorf("idempotency: marking consumer %q event %q: %w", consumer, eventID, err)
	}
	first := &pgconn.FirstStatement{SQL: s.markSQL(consumer, eventID)}
	tx, err := s.db.BeginTx(pgconn.WithFirstStatement(ctx, first), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		var pqErr *pq.Error
		if errors.As(err, &pqErr) {
			return nil, false, s.markError(ctx, consumer, eventID, err)
		}
		return nil, false, fmt.Errorf("idempotency: consumer %q event %q: begin transaction: %w", consumer, eventID, err)
	}
	t := &pgTx{tx: tx, store: s}
	if first.Sent {
		return t, first.RowsAffected == 1, nil
	}
	fresh, err := t.Mark(ctx, consumer, eventID)
	if err != nil {
		_ = tx.Rollback()
		return nil, false, err
	}
	return t, fresh, nil
}

var (
	_ Store       = (*PostgresStore)(nil)
	_ Marker      = (*PostgresStore)(nil)
	_ BeginMarker = (*PostgresStore)(nil)
	_ SQLTx       = (*pgTx)(nil)
)

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
