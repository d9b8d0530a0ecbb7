package pgconn

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
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
	withPgxKeepalives(&cfg.ConnConfig.Config)
	return cfg, nil
}

// ConnectPgx opens a pgx pool with cfg (from PgxConfig, adjusted by the
// caller) and pings it. A failed connect says what happened in the words
// of Open's connector: refused, accepted but silent within
// connect_timeout, or interrupted (by a signal or the caller's deadline).
// The error names no password; the caller adds which database it was.
func ConnectPgx(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	// Whether a dial succeeded tells a silent server from an unreachable one.
	var accepted atomic.Bool
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err == nil {
			accepted.Store(true)
		}
		return c, err
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, redact.Error(err)
	}
	start := time.Now()
	if err := p.Ping(ctx); err != nil {
		// Close waits for a connect in progress, which ends within
		// connect_timeout: not after a signal.
		if ctx.Err() == nil {
			p.Close()
		} else {
			go p.Close()
		}
		return nil, redact.Error(connectError(ctx, pgxAddr(cfg), cfg.ConnConfig.ConnectTimeout, accepted.Load(), time.Since(start), err))
	}
	return p, nil
}

// pgxAddr names the server(s) of cfg for messages, as host:port.
func pgxAddr(cfg *pgxpool.Config) string {
	one := func(host string, port uint16) string {
		if strings.HasPrefix(host, "/") {
			return host // unix socket directory
		}
		return net.JoinHostPort(host, strconv.Itoa(int(port)))
	}
	s := one(cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	for _, f := range cfg.ConnConfig.Fallbacks {
		if a := one(f.Host, f.Port); !strings.Contains(s, a) {
			s += "," + a
		}
	}
	return s
}
