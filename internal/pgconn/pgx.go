package pgconn

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/redact"
)

// OpenPgx returns a pgx pool on dsn (a postgres:// URL or key=value DSN)
// with the bounds of the package doc: connect_timeout defaults to
// DefaultConnectTimeout as in Open, and pgx itself abandons a statement
// whose context ends (it sets a deadline on the socket), so a silent
// server cannot hang a call. No connection is made until the pool's first
// use; Ping to check the server. The DSN's errors name no password.
func OpenPgx(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := PgxConfig(dsn)
	if err != nil {
		return nil, err
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, redact.Error(err)
	}
	return p, nil
}

// PgxConfig parses dsn for pgxpool with the connect timeout of Open.
func PgxConfig(dsn string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(WithConnectTimeout(dsn, 0))
	if err != nil {
		return nil, fmt.Errorf("pgconn: parsing the Postgres URL: %w", redact.Error(err))
	}
	if cfg.ConnConfig.ConnectTimeout <= 0 {
		cfg.ConnConfig.ConnectTimeout = DefaultConnectTimeout
	}
	// A dead server is found within a minute instead of when the pool's
	// idle connection is next used.
	cfg.HealthCheckPeriod = min(cfg.HealthCheckPeriod, 30*time.Second)
	return cfg, nil
}
