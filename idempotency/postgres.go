package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// PostgresStore keeps marks in the millwright_processed_events table (see
// Migrations), on a *sql.DB or a *pgxpool.Pool. Its units of work are READ
// COMMITTED database transactions: at that level a second INSERT of the
// same key waits for the first transaction and then sees the conflict,
// which is what makes concurrent duplicates safe. (At REPEATABLE READ or
// SERIALIZABLE the second would fail with a serialization error instead.)
type PostgresStore struct {
	pool        storage.Pool
	lockTimeout time.Duration
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

// NewPostgresStore returns a store on db, a *sql.DB (lib/pq, or pgx's
// stdlib adapter) or a *pgxpool.Pool. The table must exist: apply
// Migrations() with migrate.Up or `millwright migrate` first. The pool needs
// one connection per message being handled at once. On a *pgxpool.Pool the
// middleware's transaction (TxFromContext) is a pgx.Tx; on a *sql.DB a
// *sql.Tx.
func NewPostgresStore(db postgres.DB, opts ...StoreOption) (*PostgresStore, error) {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		// P is a *sql.DB or a *pgxpool.Pool: only a nil one fails.
		return nil, fmt.Errorf("idempotency: NewPostgresStore: db is nil; pass postgres.From(pool) of an open *sql.DB or *pgxpool.Pool: %w", err)
	}
	return &PostgresStore{pool: pool, lockTimeout: applyOptions(opts).lockTimeout}, nil
}

// Begin starts a READ COMMITTED transaction; its lock timeout
// (WithLockTimeout) goes with BEGIN.
func (s *PostgresStore) Begin(ctx context.Context) (Tx, error) {
	tx, err := storage.BeginProcessedMarks(ctx, s.pool, s.lockTimeout)
	if err != nil {
		return nil, fmt.Errorf("idempotency: begin transaction%s: %w", migrationHint(err), err)
	}
	return s.wrap(ctx, tx), nil
}

// wrap returns the unit of work of tx, which hands the handler the
// transaction (DatabaseTx).
func (s *PostgresStore) wrap(ctx context.Context, tx storage.Tx) Tx {
	return &pgTx{tx: tx, store: s, ctx: ctx}
}

// Processed reports whether a committed mark exists.
func (s *PostgresStore) Processed(ctx context.Context, consumer, eventID string) (bool, error) {
	if err := checkKey(consumer, eventID); err != nil {
		return false, err
	}
	found, err := storage.IsProcessed(ctx, s.pool, consumer, eventID)
	if err != nil {
		return false, fmt.Errorf("idempotency: reading mark of consumer %q event %q%s: %w", consumer, eventID, migrationHint(err), err)
	}
	return found, nil
}

// migrationHint suggests the fix when the table is missing.
func migrationHint(err error) string {
	if storage.Code(err) == "42P01" { // undefined_table
		return " (table missing: run `millwright migrate` or migrate.Up with idempotency.Migrations())"
	}
	return ""
}

// checkKey rejects what a Postgres TEXT cannot hold, so that such a message
// fails permanently instead of being retried against a database error.
func checkKey(consumer, eventID string) error {
	if strings.IndexByte(consumer, 0) >= 0 || strings.IndexByte(eventID, 0) >= 0 || !utf8.ValidString(consumer) || !utf8.ValidString(eventID) {
		return failure.Permanent(fmt.Errorf("idempotency: consumer %q event %q: %w: ids must be valid UTF-8 without NUL bytes", consumer, eventID, ErrNoEventID))
	}
	return nil
}

// Mark writes one mark in a unit of work of its own (Marker): one round
// trip, the lock timeout and the INSERT in one batch.
func (s *PostgresStore) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	if err := s.checkMark(ctx, consumer, eventID); err != nil {
		return false, err
	}
	fresh, err := storage.MarkProcessedAlone(ctx, s.pool, consumer, eventID, s.lockTimeout)
	if err != nil {
		return false, s.markError(ctx, consumer, eventID, err)
	}
	return fresh, nil
}

// checkMark refuses a mark that cannot be written.
func (s *PostgresStore) checkMark(ctx context.Context, consumer, eventID string) error {
	if err := checkKey(consumer, eventID); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("idempotency: marking consumer %q event %q: %w", consumer, eventID, err)
	}
	return nil
}

// pgTx is a unit of work of the Postgres store: a storage transaction. A
// concurrent unit of work holding an uncommitted mark of the same key makes
// Mark wait for its end; the lock timeout set at Begin bounds that wait
// even when a cancellation of ctx is lost.
type pgTx struct {
	tx    storage.Tx
	store *PostgresStore
	// ctx is Begin's: it bounds Commit, as database/sql binds a
	// transaction to BeginTx's context.
	ctx context.Context
}

// DatabaseTx returns the transaction of the unit of work.
func (t *pgTx) DatabaseTx() postgres.Tx { return storage.TxOf(t.tx) }

func (t *pgTx) Mark(ctx context.Context, consumer, eventID string) (bool, error) {
	if err := t.store.checkMark(ctx, consumer, eventID); err != nil {
		return false, err
	}
	fresh, err := storage.MarkProcessed(ctx, t.tx, consumer, eventID)
	if err != nil {
		return false, t.store.markError(ctx, consumer, eventID, err)
	}
	return fresh, nil
}

// markError says why the mark of (consumer, eventID) failed.
func (s *PostgresStore) markError(ctx context.Context, consumer, eventID string, err error) error {
	if storage.Code(err) == "55P03" { // lock_not_available
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
// eventID) in it, as Begin then Tx.Mark would, but with BEGIN in one round
// trip (on pgx always; on database/sql on a pool of postgres.Open, else
// BEGIN then the mark). When the event is a duplicate (fresh false) the
// unit of work is already ended: its Rollback does nothing.
func (s *PostgresStore) BeginMark(ctx context.Context, consumer, eventID string) (Tx, bool, error) {
	if err := s.checkMark(ctx, consumer, eventID); err != nil {
		return nil, false, err
	}
	tx, fresh, err := storage.BeginMarkProcessed(ctx, s.pool, consumer, eventID, s.lockTimeout)
	if err != nil {
		if storage.IsServerError(err) {
			return nil, false, s.markError(ctx, consumer, eventID, err)
		}
		if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
			err = fmt.Errorf("%w (%v)", ctxErr, err)
		}
		return nil, false, fmt.Errorf("idempotency: consumer %q event %q: begin transaction: %w", consumer, eventID, err)
	}
	if !fresh {
		return endedTx{}, false, nil
	}
	return s.wrap(ctx, tx), true, nil
}

// endedTx is the unit of work of a duplicate BeginMark: the mark's
// conflict ended its transaction.
type endedTx struct{}

func (endedTx) Mark(context.Context, string, string) (bool, error) {
	return false, errors.New("idempotency: Mark on the unit of work of a duplicate BeginMark, which is ended: begin another")
}
func (endedTx) Commit() error   { return nil }
func (endedTx) Rollback() error { return nil }

var (
	_ Store       = (*PostgresStore)(nil)
	_ Marker      = (*PostgresStore)(nil)
	_ BeginMarker = (*PostgresStore)(nil)
	_ DatabaseTx  = (*pgTx)(nil)
)

func (t *pgTx) Commit() error {
	if err := t.tx.Commit(t.ctx); err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	return nil
}

// rollbackTimeout bounds a Rollback, which runs even when Begin's context
// has ended (pgx closes the connection when it cannot finish in time).
const rollbackTimeout = 10 * time.Second

func (t *pgTx) Rollback() error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(t.ctx), rollbackTimeout)
	defer cancel()
	if err := t.tx.Rollback(ctx); err != nil {
		return fmt.Errorf("idempotency: rollback: %w", err)
	}
	return nil
}
