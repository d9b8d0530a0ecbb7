package idempotency

import (
	"context"

	"github.com/millwright/millwright/postgres"
)

// Store keeps the processed marks of (consumer, event id) pairs.
// Implementations must be safe for concurrent use.
type Store interface {
	// Begin starts a unit of work in which marks are written. The marks
	// become visible to other units of work only on Commit and disappear on
	// Rollback.
	Begin(ctx context.Context) (Tx, error)
	// Processed reports whether consumer has a committed mark for eventID.
	// It does not wait for uncommitted marks of other units of work.
	Processed(ctx context.Context, consumer, eventID string) (bool, error)
}

// Tx is one unit of work of a Store. A Tx is used by one goroutine at a time.
type Tx interface {
	// Mark records that consumer processed eventID. It returns true when this
	// call wrote the mark and false when a mark already existed. When another
	// unit of work holds an uncommitted mark for the same pair, Mark waits
	// until that unit commits (then returns false) or rolls back (then
	// writes the mark and returns true), or until ctx is done.
	Mark(ctx context.Context, consumer, eventID string) (bool, error)
	// Commit makes the marks of this unit of work durable and visible.
	Commit() error
	// Rollback discards the marks of this unit of work. It is safe to call
	// after Commit or a previous Rollback; it then does nothing and returns
	// nil or an error that callers may ignore.
	Rollback() error
}

// Marker is implemented by a Store that writes a single mark, in a unit of
// work of its own, more cheaply than Begin, Mark and Commit (the Postgres
// store: one autocommit statement and one round trip instead of three).
// MarkAfterSuccess mode uses it when the store has it. Mark has the
// semantics of Tx.Mark followed by Commit.
type Marker interface {
	Mark(ctx context.Context, consumer, eventID string) (bool, error)
}

// BeginMarker is implemented by a Store that begins a unit of work and
// writes its first mark more cheaply than Begin then Tx.Mark (the Postgres
// store on a pool of postgres.Open: the mark travels with BEGIN).
// Transactional mode uses it when the store has it. BeginMark has the
// semantics of Begin followed by Tx.Mark; on error no unit of work is
// left open. When fresh is false the unit of work may already be ended
// (the Postgres store's is: the duplicate ended its transaction); call
// only Rollback on it.
type BeginMarker interface {
	BeginMark(ctx context.Context, consumer, eventID string) (tx Tx, fresh bool, err error)
}

// DatabaseTx is implemented by a Tx that runs on a Postgres transaction
// (the Postgres store's, on either driver). The middleware hands that
// transaction to the handler through the message context, see
// TxFromContext.
type DatabaseTx interface {
	DatabaseTx() postgres.Tx
}

type txKey struct{}

// withTx returns ctx carrying tx.
func withTx(ctx context.Context, tx Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the database transaction that the middleware opened
// for the message whose context is ctx (use msg.Context()), on whichever
// driver the store runs. Write the handler's effects through it (tx.SQL()
// or tx.Pgx(), and outbox.Add(ctx, tx, ...)): they commit atomically with
// the processed mark, and roll back with it when the handler returns an
// error. ok is false outside the middleware, in MarkAfterSuccess mode, and
// with a store that is not on Postgres (the in-memory store).
func TxFromContext(ctx context.Context) (tx postgres.Tx, ok bool) {
	dt, ok := ctx.Value(txKey{}).(DatabaseTx)
	if !ok {
		return postgres.Tx{}, false
	}
	return dt.DatabaseTx(), true
}

// StoreTxFromContext returns the store unit of work the middleware opened for
// the message whose context is ctx, whatever the store. Handlers that run on
// the in-memory store in unit tests can use it to tell that they run inside
// the middleware.
func StoreTxFromContext(ctx context.Context) (Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(Tx)
	return tx, ok
}
