package outbox

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the outbox's SQL migrations for migrate.Up. They create
// the millwright_outbox table in the first schema of the search_path.
func Migrations() migrate.Source {
	return migrate.Embedded("outbox", migrationFiles, "migrations")
}
