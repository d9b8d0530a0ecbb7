package idempotency

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationsFS embed.FS

// Migrations returns the SQL migrations that create the processed-events
// table, for migrate.Up or `millwright migrate`.
func Migrations() migrate.Source {
	return migrate.Embedded("idempotency", migrationsFS, "migrations")
}
