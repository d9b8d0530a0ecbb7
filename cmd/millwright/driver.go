package main

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

// The Postgres driver of the components a command runs (--driver).
const (
	envDriver     = cli.EnvDriver
	driverPQ      = cli.DriverPQ
	driverPgx     = cli.DriverPgx
	defaultDriver = cli.DefaultDriver
)

// addDriverFlag adds --driver, persistent, to the root: every command
// takes it.
func addDriverFlag(cmd *cobra.Command) {
	cli.AddDriverFlag(cmd, "Every command that reads or changes millwright's tables runs on one pool of it, its audit row included: relay, clean and every <component> clean, outbox status and retry-failed, dlq list, show and replay, saga list, show and resolve, idempotency stats, audit list."+
		" migrate uses database/sql")
}

// driverOf returns the driver the command uses: --driver, else
// $MILLWRIGHT_DATABASE_DRIVER, else pgx.
func driverOf(cmd *cobra.Command) (string, error) { return cli.DriverOf(cmd) }

// driverFrom is driverOf with the environment read through lookup.
func driverFrom(cmd *cobra.Command, lookup func(string) (string, bool)) (string, error) {
	return cli.DriverFrom(cmd, lookup)
}

// cliPool is the one database pool of a command invocation, on the
// driver of --driver: a *sql.DB (pq) or a *pgxpool.Pool (pgx), never both.
// Everything the command does in millwright's tables, its audit row
// included, goes through it.
type cliPool struct {
	sql *sql.DB       // with pq
	pgx *pgxpool.Pool // with pgx
}

// openPool opens the pool of the command's --driver on the URL and schema
// of --database-url and --schema, checked with a ping (connects bounded
// by connect_timeout on both drivers). Errors name the database without
// its password. The caller closes the pool.
func openPool(cmd *cobra.Command) (*cliPool, error) {
	d, err := driverOf(cmd)
	if err != nil {
		return nil, err
	}
	if d == driverPQ {
		db, err := openDB(cmd)
		if err != nil {
			return nil, err
		}
		return &cliPool{sql: db}, nil
	}
	u, err := commandURL(cmd)
	if err != nil {
		return nil, err
	}
	p, err := openPgx(cmd.Context(), u)
	if err != nil {
		return nil, err
	}
	return &cliPool{pgx: p}, nil
}

// handle is the pool as the components take it.
func (p *cliPool) handle() postgres.DB {
	if p.pgx != nil {
		return postgres.Pgx(p.pgx)
	}
	return postgres.SQL(p.sql)
}

// storage is the pool as a storage.Pool, for the CLI's own reads.
func (p *cliPool) storage() storage.Pool {
	if p.pgx != nil {
		return storage.NewPgxPool(p.pgx)
	}
	return storage.NewSQLPool(p.sql)
}

// Close closes the pool.
func (p *cliPool) Close() {
	if p.pgx != nil {
		p.pgx.Close()
		return
	}
	_ = p.sql.Close()
}

// openPgx opens a pgx pool on u (pgconn.PgxConfig: connect_timeout as
// lib/pq's) and pings it; pgconn.ConnectPgx says what a failed connect
// was, as the database/sql pool's do.
func openPgx(ctx context.Context, u string) (*pgxpool.Pool, error) {
	cfg, err := pgconn.PgxConfig(u)
	if err != nil {
		return nil, fmt.Errorf("opening database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	p, err := pgconn.ConnectPgx(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	return p, nil
}

// openCleaner builds a table's cleaner (retention.NewOutboxCleaner, ...).
type openCleaner func(db postgres.DB, cfg retention.Config) (*retention.Cleaner, error)
