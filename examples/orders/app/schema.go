package app

import (
	"embed"

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the example's own tables (orders_* prefix).
func Migrations() migrate.Source {
	return migrate.Embedded("orders_example", migrationFiles, "migrations")
}

// AllMigrations returns every migration the example needs: millwright's
// (migrations.All: outbox, idempotency, dead-letter, saga and the operator
// CLI's audit tables), then its own.
func AllMigrations() []migrate.Source {
	return append(migrations.All(), Migrations())
}
