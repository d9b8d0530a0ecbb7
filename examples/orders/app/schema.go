package app

import (
	"embed"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the example's own tables (orders_* prefix).
func Migrations() migrate.Source {
	return migrate.Embedded("orders_example", migrationFiles, "migrations")
}

// AllMigrations returns every migration the example needs: millwright's
// outbox, idempotency, dead-letter and saga tables, then its own.
func AllMigrations() []migrate.Source {
	return []migrate.Source{outbox.Migrations(), idempotency.Migrations(), dlq.Migrations(), saga.Migrations(), Migrations()}
}
