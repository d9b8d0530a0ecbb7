package main

import (
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/internal/cleaner"
)

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
