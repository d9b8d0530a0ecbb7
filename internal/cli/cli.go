// Package cli holds what the operator command (cmd/millwright) and the
// benchmark command (cmd/millwright-bench) share: the --database-url and
// --driver flags and how they resolve, opening a checked database/sql
// pool, and a long operation's progress report on stderr.
package cli

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/redact"
)

// DefaultDatabaseURL is the local development server.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// AddDatabaseFlag adds --database-url to cmd.
func AddDatabaseFlag(cmd *cobra.Command) {
	cmd.Flags().String("database-url", "", "Postgres URL (default $MILLWRIGHT_DATABASE_URL, else "+DefaultDatabaseURL+"); connect_timeout=10 (seconds) applies unless the URL or $PGCONNECT_TIMEOUT sets one")
}

// DatabaseURL is the database URL of --database-url's value flag: flag,
// else $MILLWRIGHT_DATABASE_URL, else DefaultDatabaseURL.
func DatabaseURL(flag string) string {
	if flag != "" {
		return flag
	}
	if u := os.Getenv("MILLWRIGHT_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}

// OpenDB opens a database/sql pool on u with open and pings it. Errors
// name the database without its password.
func OpenDB(ctx context.Context, u string, open func(string) (*sql.DB, error)) (*sql.DB, error) {
	db, err := open(u)
	if err != nil {
		return nil, fmt.Errorf("opening database %s: %w", redact.URL(u), redact.Error(err))
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		// lib/pq's URL parse errors quote the whole URL, password included.
		return nil, fmt.Errorf("connecting to database %s: %w", redact.URL(u), redact.Error(err))
	}
	return db, nil
}

// WithDSNParam returns dsn (a postgres:// URL or a key=value DSN) with key
// set to value, replacing the DSN's own (lib/pq takes the last of a
// repeated key=value).
func WithDSNParam(dsn, key, value string) string {
	u, err := url.Parse(dsn)
	if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
		return dsn + " " + key + "='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(value) + "'"
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}
