// Package pgtest gives each test an isolated Postgres schema with the
// migrations it needs applied, and drops the schema when the test ends.
//
// The server is taken from MILLWRIGHT_TEST_DATABASE_URL, defaulting to the
// local server (postgres://postgres@127.0.0.1:5432/test?sslmode=disable).
package pgtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq" // also registers the "postgres" driver

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

// EnvDatabaseURL names the environment variable holding the test server's URL.
const EnvDatabaseURL = "MILLWRIGHT_TEST_DATABASE_URL"

// DefaultURL is the local server every development and CI machine has.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// BaseURL returns the URL of the test server, with the session bounds
// every test connection gets (WithSessionBounds).
func BaseURL() string {
	if u := os.Getenv(EnvDatabaseURL); u != "" {
		return WithSessionBounds(u)
	}
	return WithSessionBounds(DefaultURL)
}

// MaxOpenConns bounds each test schema's pool. With go test running two
// packages at a time and a few parallel tests each, this keeps the suite
// far below the server's 100 connections.
const MaxOpenConns = 10

// Schema is an isolated schema created for one test.
type Schema struct {
	// Name of the schema, e.g. "t_3f9a0c1d2e".
	Name string
	// URL reaches the server with search_path set to the schema, for code
	// that opens its own connections (watermill-sql, separate processes).
	URL string
	// DB is a pool on URL, closed at test cleanup.
	DB *sql.DB
}

// New creates a fresh schema, applies the given migrations to it and
// registers cleanup that closes the pool and drops the schema.
func New(tb testing.TB, sources ...migrate.Source) *Schema {
	tb.Helper()
	ctx := context.Background()

	admin, err := sql.Open("postgres", WithSessionBounds(BaseURL()))
	if err != nil {
		tb.Fatalf("pgtest: open %s: %v", EnvDatabaseURL, err)
	}
	admin.SetMaxOpenConns(2)

	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	if _, err := admin.ExecContext(ctx, `CREATE SCHEMA `+name); err != nil {
		admin.Close()
		tb.Fatalf("pgtest: create schema (is Postgres running? set %s): %v", EnvDatabaseURL, err)
	}

	u := WithSessionBounds(WithSearchPath(BaseURL(), name))
	db, err := sql.Open("postgres", u)
	if err != nil {
		tb.Fatalf("pgtest: open schema pool: %v", err)
	}
	db.SetMaxOpenConns(MaxOpenConns)
	tb.Cleanup(func() {
		db.Close()
		_, _ = admin.ExecContext(context.Background(), `DROP SCHEMA `+name+` CASCADE`)
		admin.Close()
	})
	if len(sources) > 0 {
		if _, err := migrate.Up(ctx, postgres.From(db), sources...); err != nil {
			tb.Fatalf("pgtest: migrate: %v", err)
		}
	}
	return &Schema{Name: name, URL: u, DB: db}
}

// ToolURL returns the test server's URL as configured, without the session
// bounds, for libpq tools such as psql (which refuse parameters they do
// not know).
func ToolURL() string {
	if u := os.Getenv(EnvDatabaseURL); u != "" {
		return u
	}
	return DefaultURL
}

// Session bounds every test connection gets (see WithSessionBounds).
const (
	// IdleInTransactionTimeout ends a session left idle in a transaction:
	// such a session holds the server-wide xmin horizon, below which
	// watermill-sql's consumers read, so one forgotten transaction would
	// stall every sql-transport consumer of every package for as long.
	IdleInTransactionTimeout = 60 * time.Second
	// StatementTimeout ends a statement that runs (or waits on a lock)
	// longer than any test should.
	StatementTimeout = 2 * time.Minute
)

// WithSessionBounds returns rawURL with idle_in_transaction_session_timeout
// and statement_timeout set, unless the URL sets them itself.
func WithSessionBounds(rawURL string) string {
	set := func(key string, d time.Duration) {
		v := strconv.FormatInt(d.Milliseconds(), 10)
		u, err := url.Parse(rawURL)
		if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
			if !strings.Contains(rawURL, key+"=") {
				rawURL += " " + key + "=" + v
			}
			return
		}
		q := u.Query()
		if q.Get(key) != "" {
			return
		}
		q.Set(key, v)
		u.RawQuery = q.Encode()
		rawURL = u.String()
	}
	set("idle_in_transaction_session_timeout", IdleInTransactionTimeout)
	set("statement_timeout", StatementTimeout)
	return rawURL
}

// WithSearchPath returns rawURL with its search_path set to schema.
// lib/pq passes unknown URL parameters to the server as run-time settings.
func WithSearchPath(rawURL, schema string) string {
	u, err := url.Parse(rawURL)
	if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
		// key=value DSN
		return rawURL + " search_path=" + schema
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// WaitingOnLock returns how many of the given backends wait on a lock
// (pg_stat_activity.wait_event_type = 'Lock'), for tests that must see a
// session blocked before they release what blocks it.
func WaitingOnLock(tb testing.TB, db *sql.DB, pids ...int) int {
	tb.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND wait_event_type = 'Lock'`,
		pq.Array(pids)).Scan(&n); err != nil {
		tb.Fatalf("pgtest: reading pg_stat_activity: %v", err)
	}
	return n
}

// LastQuery returns the query the backend pid last received (its
// pg_stat_activity.query), for tests that check what one round trip
// carried.
func LastQuery(tb testing.TB, db *sql.DB, pid int) string {
	tb.Helper()
	var q string
	if err := db.QueryRow(`SELECT query FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&q); err != nil {
		tb.Fatalf("pgtest: reading pg_stat_activity of backend %d: %v", pid, err)
	}
	return q
}

// Querier is what Column reads through: a *sql.DB, *sql.Conn or *sql.Tx.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Column returns the one column of query's rows, failing the test on any
// error.
func Column[T any](tb testing.TB, q Querier, query string, args ...any) []T {
	tb.Helper()
	rows, err := q.QueryContext(context.Background(), query, args...)
	if err != nil {
		tb.Fatalf("pgtest: %s: %v", query, err)
	}
	defer rows.Close()
	var out []T
	for rows.Next() {
		var v T
		if err := rows.Scan(&v); err != nil {
			tb.Fatalf("pgtest: %s: %v", query, err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		tb.Fatalf("pgtest: %s: %v", query, err)
	}
	return out
}

// Plan returns the EXPLAIN output of query with sequential scans disabled
// (a test table is too small for the planner to prefer an index), for tests
// that check which index serves a query. The transaction it runs in is
// rolled back at once.
func Plan(tb testing.TB, db *sql.DB, query string, args ...any) string {
	tb.Helper()
	tx, err := db.Begin()
	if err != nil {
		tb.Fatalf("pgtest: Plan: %v", err)
	}
	defer tx.Rollback() //nolint:errcheck // read only
	if _, err := tx.Exec(`SET LOCAL enable_seqscan = off`); err != nil {
		tb.Fatalf("pgtest: Plan: %v", err)
	}
	lines := Column[string](tb, tx, `EXPLAIN `+query, args...)
	return strings.Join(lines, "\n")
}
