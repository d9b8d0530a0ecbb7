// Package postgres opens pools on Postgres the way millwright opens its
// own, for the services that use millwright: database/sql pools on lib/pq
// (Open) and pgx pools (OpenPgx); Pool is the constraint of the
// components that run on either. Open's pools:
//
//   - a connection attempt is bounded (connect_timeout=10 unless the DSN
//     or PGCONNECT_TIMEOUT sets one), and a call whose context ends is
//     abandoned at once, its connection closed, even when the server has
//     stopped answering (lib/pq alone waits for a silent server);
//   - a transaction millwright begins itself can carry its first
//     statements with BEGIN, in one round trip (idempotency's Postgres
//     store sends the processed-event mark of Transactional mode so;
//     OpenPgx's pools do the same; on any other *sql.DB it still works,
//     one round trip slower).
//
// Every statement is sent when it is issued, on every pool (this one, any
// other *sql.DB, pgx): outbox.Add sends its INSERT at once, in one round
// trip, and its server-side errors are Add's own; none is held until
// COMMIT.
//
// Transactions are begun and ended with simple queries of millwright's own
// (BEGIN with lib/pq's options, COMMIT, ROLLBACK); Commit of a transaction
// in which a statement failed returns pq.ErrInFailedTransaction, as lib/pq
// does.
//
// Everything else is lib/pq's: the DSN (a postgres:// URL or key=value
// pairs), the types, the errors (*pq.Error).
package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/pgconn"
)

// Pool is a connection pool millwright's components run on: a *sql.DB
// (lib/pq, or pgx's stdlib adapter) or a *pgxpool.Pool. The relay, the
// orchestrator, the idempotency store, the dead-letter store and the
// cleaners take either.
type Pool interface {
	*sql.DB | *pgxpool.Pool
}

// OpenPgx returns a pgx pool on dsn with millwright's bounds: a connection
// attempt is bounded (connect_timeout=10 unless the DSN or
// PGCONNECT_TIMEOUT sets one) and a call whose context ends is abandoned at
// once (pgx's own behaviour). The DSN is parsed now: an error names no
// password. No connection is made until the pool's first use.
func OpenPgx(ctx context.Context, dsn string) (*pgxpool.Pool, error) { return pgconn.OpenPgx(ctx, dsn) }

// Open returns a pool on dsn, as sql.Open("postgres", dsn) would, with the
// bounds and the round trips of the package doc. The DSN is parsed now: an
// error names no password.
func Open(dsn string) (*sql.DB, error) { return pgconn.Open(dsn) }

// NewConnector returns the connector Open uses, for sql.OpenDB (to wrap it,
// for instance with a tracing driver).
func NewConnector(dsn string) (driver.Connector, error) { return pgconn.NewConnector(dsn) }
