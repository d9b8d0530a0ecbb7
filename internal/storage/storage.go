package storage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"
)

// Driver names the driver a Querier runs on.
type Driver string

const (
	// DriverSQL is database/sql (lib/pq, or pgx's stdlib adapter).
	DriverSQL Driver = "database/sql"
	// DriverPgx is pgx v5 (pgx.Tx, *pgx.Conn, *pgxpool.Pool).
	DriverPgx Driver = "pgx"
)

// Statement is one SQL statement and its $n arguments.
//
// Arguments are nil, string, []byte, bool, the integer types, float64,
// time.Time, []int64, []string, or a driver.Valuer giving one of these.
// JSON goes as a string (a []byte is bytea).
//
// Both drivers store an argument as the same value: a time.Time as its
// instant, to the microsecond (the fraction cut), whatever its offset or
// year (Go's year 0 is Postgres' 1 BC); a float32 as its exact value. An
// argument Postgres cannot store as it is (text with a NUL byte or invalid
// UTF-8; a time outside CheckTime's range) is refused before anything is
// sent, with a *ValueError naming it that matches ErrUnstorable.
type Statement struct {
	SQL  string
	Args []any
	// Expect, when not NoExpect, is the number of rows the statement (an
	// INSERT, UPDATE or DELETE without its own RETURNING clause) must
	// affect: any other count fails it with a *ConflictError, on the
	// server, so that nothing after it in its batch or transaction runs.
	Expect int64
	// What names the statement in errors ("inserting 3 outbox events").
	What string
}

// NoExpect is Statement.Expect's value for no expectation.
const NoExpect = -1

// S returns a Statement with no expectation.
func S(sql string, args ...any) Statement {
	return Statement{SQL: sql, Args: args, Expect: NoExpect}
}

// Row is one row of a Query, scanned with the database/sql conventions
// (sql.Null* and sql.Scanner destinations work on both drivers). Arrays
// scan through Array.
type Row interface {
	Scan(dest ...any) error
}

// Querier runs statements on a driver's connection, pool or transaction.
// Implementations are safe for concurrent use when what they wrap is (a
// pool is, a transaction is not).
type Querier interface {
	// Driver names the driver.
	Driver() Driver
	// Exec runs s and returns the number of rows it affected.
	Exec(ctx context.Context, s Statement) (int64, error)
	// Query runs s and calls scan for each row, in order, until scan
	// returns an error (which Query returns).
	Query(ctx context.Context, s Statement, scan func(Row) error) error
	// QueryRow runs s and scans its first row into dest; no row is an
	// error for which errors.Is(err, sql.ErrNoRows) holds.
	QueryRow(ctx context.Context, s Statement, dest ...any) error
	// Batch runs ss in order, in one round trip, and stops at the first
	// that fails; its error names the statement (BatchError). Outside a
	// transaction the batch is atomic.
	Batch(ctx context.Context, ss ...Statement) error
}

// IsolationLevel of a transaction.
type IsolationLevel int

const (
	// ReadCommitted is the default.
	ReadCommitted IsolationLevel = iota
	RepeatableRead
	Serializable
)

// TxOptions configure Pool.Begin.
type TxOptions struct {
	Isolation IsolationLevel
	ReadOnly  bool
	// First are statements sent with BEGIN, in the same round trip, as
	// the transaction's first. Their error (a *ConflictError for an
	// unmet Expect) is Begin's, and no transaction is left open.
	First []Statement
}

// Pool is a driver's connection pool.
type Pool interface {
	Querier
	// Begin starts a transaction.
	Begin(ctx context.Context, opts TxOptions) (Tx, error)
	// Handle returns what the pool wraps: a *sql.DB or a *pgxpool.Pool.
	Handle() any
}

// Tx is a transaction. Commit and Rollback end it; Rollback after Commit
// is a no-op, so `defer tx.Rollback(ctx)` is safe.
type Tx interface {
	Querier
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
	// Handle returns the transaction for user code: a *sql.Tx or a
	// pgx.Tx.
	Handle() any
}

// ConflictError is the error of a statement whose Expect was not met.
type ConflictError struct {
	// Index is the statement's position in its batch (0 for Exec).
	Index int
	// What is the statement's What.
	What string
	// Affected is the number of rows it affected.
	Affected int64
	// Expected is its Expect.
	Expected int64
}

func (e *ConflictError) Error() string {
	what := e.What
	if what == "" {
		what = fmt.Sprintf("statement %d", e.Index)
	}
	return fmt.Sprintf("storage: %s affected %d row(s), want %d (a concurrent writer changed them)", what, e.Affected, e.Expected)
}

// ErrConflict is matched by every *ConflictError (errors.Is).
var ErrConflict = errors.New("storage: conflicting concurrent write")

func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// BatchError is the error of a statement of a batch.
type BatchError struct {
	Index int
	Count int
	What  string
	Err   error
}

func (e *BatchError) Error() string {
	if e.What != "" {
		return fmt.Sprintf("storage: batch statement %d of %d (%s): %v", e.Index+1, e.Count, e.What, e.Err)
	}
	return fmt.Sprintf("storage: batch statement %d of %d: %v", e.Index+1, e.Count, e.Err)
}

func (e *BatchError) Unwrap() error { return e.Err }

// ErrUnstorable is matched (errors.Is) by the error of a statement
// argument that Postgres cannot store as it is (text with a NUL byte or
// invalid UTF-8, a time outside the range both drivers store): it is
// refused before anything is sent, on both drivers, and sending it again
// fails the same way.
var ErrUnstorable = errors.New("storage: a value Postgres cannot store")

// ValueError is the error of a statement argument refused before it was
// sent: one Postgres cannot store (errors.Is(err, ErrUnstorable)) or of a
// type the driver cannot send.
type ValueError struct {
	// What is the statement's What.
	What string
	// Arg is the argument's number: $Arg.
	Arg int
	// Field names the argument for an operator (a column: "last_failure_at"),
	// when the operation that built the statement knows it; "" otherwise.
	Field string
	// Err says why.
	Err error
}

func (e *ValueError) Error() string {
	arg := fmt.Sprintf("argument $%d", e.Arg)
	if e.Field != "" {
		arg = fmt.Sprintf("%s ($%d)", e.Field, e.Arg)
	}
	if e.What != "" {
		return fmt.Sprintf("storage: %s: %s: %v", e.What, arg, e.Err)
	}
	return fmt.Sprintf("storage: %s: %v", arg, e.Err)
}

func (e *ValueError) Unwrap() error { return e.Err }

// nameField sets the Field of err's *ValueError, if it has one, to the
// name fields gives its argument ($1 is fields[0]).
func nameField(err error, fields ...string) error {
	var ve *ValueError
	if errors.As(err, &ve) && ve.Field == "" && ve.Arg >= 1 && ve.Arg <= len(fields) {
		ve.Field = fields[ve.Arg-1]
	}
	return err
}

// IsDataError reports whether err says a value cannot be stored: refused
// before it was sent (ErrUnstorable) or by the server (SQLSTATE class 22,
// data exception: a time or number out of range, text in no valid
// encoding). Sending the same values again fails the same way.
func IsDataError(err error) bool {
	c := Code(err)
	return len(c) == 5 && c[:2] == "22" && !errors.Is(err, ErrConflict)
}

// Hint returns the advice to add to an error of a statement, by its real
// cause: " (did `millwright migrate` run?)" for a table, column, function
// or schema that does not exist; a refused value's advice for a data
// error; "" otherwise (a connection error, a conflict, a cancelled
// context: no migration would fix those).
func Hint(err error) string {
	switch {
	case err == nil:
		return ""
	case IsDataError(err):
		return " (a value the database cannot store: sending it again fails the same way)"
	}
	switch Code(err) {
	case "42P01", "42703", "42883": // undefined_table, _column, _function
		return " (did `millwright migrate` run?)"
	case "3F000": // invalid_schema_name: no schema of the search_path exists
		return " (the schema of the connection's search_path does not exist: create it, or point the search_path at the schema `millwright migrate` ran in)"
	}
	return ""
}

// Code returns the SQLSTATE of a server error of either driver, or of a
// value refused before it was sent (ErrUnstorable: the server's code for
// the same refusal, a class 22 data exception), "" for any other error.
func Code(err error) string {
	var u unstorable
	if errors.As(err, &u) {
		return u.code
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// ServerMessage returns the message of a server error of either driver
// ("" when err is not one).
func ServerMessage(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return pqErr.Message
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Message
	}
	return ""
}

// IsServerError reports whether err came from the server (a statement
// that was refused), or was refused before it was sent for a value the
// server would refuse (ErrUnstorable), rather than from the connection.
func IsServerError(err error) bool { return Code(err) != "" }

// IsNoRows reports whether err means a QueryRow found no row.
func IsNoRows(err error) bool { return errors.Is(err, sql.ErrNoRows) }

// Array wraps a pointer to a []int64, []string, []bool or []float64 so
// that Row.Scan fills it from a Postgres array on either driver.
func Array(p any) any { return arrayDest{p} }

type arrayDest struct{ p any }

// firstRow is QueryRow on q: the first row of s scanned into dest, the
// rest read and dropped; no row is sql.ErrNoRows (pgx.ErrNoRows wraps it).
func firstRow(ctx context.Context, q Querier, s Statement, dest []any) error {
	found := false
	err := q.Query(ctx, s, func(r Row) error {
		if found {
			return nil
		}
		found = true
		return r.Scan(dest...)
	})
	if err == nil && !found {
		return sql.ErrNoRows
	}
	return err
}
