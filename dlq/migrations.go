package dlq

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the dlq's SQL migrations for migrate.Up. They create
// the millwright_dead_letters table in the first schema of the search_path.
func Migrations() migrate.Source {
	return migrate.Embedded("dlq", migrationFiles, "migrations")
}
