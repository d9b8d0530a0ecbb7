package outbox

import (
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// driverBundle is a schema with the outbox's tables and a pool of one
// driver: handle is its *sql.DB or a *pgxpool.Pool. (The relay's tests,
// package outbox/relay, have their own.)
type driverBundle struct {
	db     *sql.DB
	schema *pgtest.Schema
	handle any
}

func setupDriver(t *testing.T, driver string) driverBundle {
	t.Helper()
	s := pgtest.New(t, Migrations())
	var h any = s.DB
	if driver == pgtest.DriverPgx {
		h = s.Pgx(t)
	}
	return driverBundle{db: s.DB, schema: s, handle: h}
}

func count(t *testing.T, db *sql.DB, where string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+where).Scan(&n))
	return n
}
