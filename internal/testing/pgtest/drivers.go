package pgtest

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// EnvDrivers names the environment variable listing the drivers the driver
// matrix runs on: "pq", "pgx" or "pq,pgx" (the default).
const EnvDrivers = "MILLWRIGHT_TEST_DRIVERS"

// Driver names of the test matrix.
const (
	DriverPQ  = "pq"
	DriverPgx = "pgx"
)

// Drivers returns the drivers of the matrix (EnvDrivers).
func Drivers() []string {
	v := strings.TrimSpace(os.Getenv(EnvDrivers))
	if v == "" {
		return []string{DriverPQ, DriverPgx}
	}
	var out []string
	for _, d := range strings.Split(v, ",") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}

// ForEachDriver runs f as a subtest per driver of the matrix.
func ForEachDriver(t *testing.T, f func(t *testing.T, driver string)) {
	t.Helper()
	for _, d := range Drivers() {
		t.Run(d, func(t *testing.T) { f(t, d) })
	}
}

// Pgx returns a pgx pool on s.URL (at most MaxOpenConns connections),
// closed at test cleanup.
func (s *Schema) Pgx(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgconn.PgxConfig(s.URL)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = MaxOpenConns
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("pgtest: opening a pgx pool: %v", err)
	}
	tb.Cleanup(p.Close)
	return p
}

// Pool returns a storage.Pool on s for driver: s.DB for DriverPQ, a new
// pgx pool for DriverPgx.
func (s *Schema) Pool(tb testing.TB, driver string) storage.Pool {
	tb.Helper()
	switch driver {
	case DriverPQ:
		return storage.NewSQLPool(s.DB)
	case DriverPgx:
		return storage.NewPgxPool(s.Pgx(tb))
	}
	tb.Fatalf("pgtest: unknown driver %q in %s: want pq or pgx", driver, EnvDrivers)
	return nil
}

// Handle returns the pool of driver as user code holds it: s.DB (a
// *sql.DB) or a *pgxpool.Pool.
func (s *Schema) Handle(tb testing.TB, driver string) any {
	tb.Helper()
	return s.Pool(tb, driver).Handle()
}

// Handles returns a postgres.DB on the driver's pool of the schema, closed at
// the test's end.
func (s *Schema) Handles(tb testing.TB, driver string) postgres.DB {
	tb.Helper()
	switch h := s.Handle(tb, driver).(type) {
	case *pgxpool.Pool:
		return postgres.Pgx(h)
	case *sql.DB:
		return postgres.SQL(h)
	}
	tb.Fatalf("pgtest: no DB for driver %q", driver)
	return postgres.DB{}
}
