package main

import (
	"database/sql"
	"fmt"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/postgres"
)

// The Postgres driver of the components a command runs (--driver).
const (
	envDriver = "MILLWRIGHT_DATABASE_DRIVER"
	driverPQ  = "pq"
	driverPgx = "pgx"
	// defaultDriver: the components run on pgxpool (issue 32).
	defaultDriver = driverPgx
)

// addDriverFlag adds --driver, persistent, to the root: every command
// takes it.
func addDriverFlag(cmd *cobra.Command) {
	cmd.PersistentFlags().String("driver", "", "Postgres driver of the components a command runs: pgx (a pgxpool.Pool) or pq (database/sql on lib/pq); default $"+
		envDriver+", else "+defaultDriver+". The cleaners of clean and <component> clean use it; migrations, the audit trail and the other commands use database/sql")
}

// driverOf returns the driver the command uses: --driver, else
// $MILLWRIGHT_DATABASE_DRIVER, else pgx.
func driverOf(cmd *cobra.Command) (string, error) { return driverFrom(cmd, os.LookupEnv) }

// driverFrom is driverOf with the environment read through lookup.
func driverFrom(cmd *cobra.Command, lookup func(string) (string, bool)) (string, error) {
	d, from := "", "--driver"
	if f := cmd.Flags().Lookup("driver"); f != nil && f.Changed {
		d = f.Value.String()
	} else if v, ok := lookup(envDriver); ok {
		d, from = v, "$"+envDriver
	}
	switch d = strings.ToLower(strings.TrimSpace(d)); d {
	case "":
		return defaultDriver, nil
	case driverPQ, driverPgx:
		return d, nil
	}
	return "", fmt.Errorf("driver %q (%s): want pgx or pq", d, from)
}

// openPool returns the pool the command's components run on for its
// --driver: db itself for pq, a new pgx pool on the same URL and schema
// for pgx (bounded connects: postgres.OpenPgx), checked with a ping. The
// caller calls closePool.
func openPool(cmd *cobra.Command, db *sql.DB) (pool any, closePool func(), err error) {
	d, err := driverOf(cmd)
	if err != nil {
		return nil, nil, err
	}
	if d == driverPQ {
		return db, func() {}, nil
	}
	u, err := commandURL(cmd)
	if err != nil {
		return nil, nil, err
	}
	p, err := postgres.OpenPgx(cmd.Context(), u)
	if err != nil {
		return nil, nil, fmt.Errorf("opening database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	if err := p.Ping(cmd.Context()); err != nil {
		p.Close()
		return nil, nil, fmt.Errorf("connecting to database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	return p, p.Close, nil
}

// openCleaner builds a component's cleaner on the CLI's pool: a *sql.DB
// or a *pgxpool.Pool (--driver).
type openCleaner func(db any, cfg cleaner.Config) (*cleaner.Cleaner, error)

// cleanerOf is the openCleaner of a component's generic NewCleaner,
// instantiated for each driver.
func cleanerOf(onSQL func(*sql.DB, cleaner.Config) (*cleaner.Cleaner, error), onPgx func(*pgxpool.Pool, cleaner.Config) (*cleaner.Cleaner, error)) openCleaner {
	return func(db any, cfg cleaner.Config) (*cleaner.Cleaner, error) {
		switch db := db.(type) {
		case *sql.DB:
			return onSQL(db, cfg)
		case *pgxpool.Pool:
			return onPgx(db, cfg)
		}
		return nil, fmt.Errorf("cmd/millwright: %T is neither a *sql.DB nor a *pgxpool.Pool", db)
	}
}
