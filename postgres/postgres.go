// Package postgres opens database/sql pools on Postgres (lib/pq) the way
// millwright opens its own, for the services that use millwright:
//
//   - a connection attempt is bounded (connect_timeout=10 unless the DSN
//     or PGCONNECT_TIMEOUT sets one), and a call whose context ends is
//     abandoned at once, its connection closed, even when the server has
//     stopped answering (lib/pq alone waits for a silent server);
//   - idempotency's Postgres store sends the processed-event mark of
//     Transactional mode with BEGIN, in one round trip, instead of in a
//     round trip of its own (on any other *sql.DB it still works, one
//     round trip slower).
//
// Everything else is lib/pq's: the DSN (a postgres:// URL or key=value
// pairs), the types, the errors (*pq.Error).
package postgres

import (
	"database/sql"
	"database/sql/driver"

	"github.com/millwright/millwright/internal/pgconn"
)

// Open returns a pool on dsn, as sql.Open("postgres", dsn) would, with the
// bounds and the round trip of the package doc. The DSN is parsed now: an
// error names no password.
func Open(dsn string) (*sql.DB, error) { return pgconn.Open(dsn) }

// NewConnector returns the connector Open uses, for sql.OpenDB (to wrap it,
// for instance with a tracing driver).
func NewConnector(dsn string) (driver.Connector, error) { return pgconn.NewConnector(dsn) }
