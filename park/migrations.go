package park

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns park's SQL migrations for migrate.Up. They create
// millwright_parked_keys and millwright_parked_messages in the first schema
// of the search_path. `millwright migrate` applies them with the others.
func Migrations() migrate.Source {
	return migrate.Embedded("park", migrationFiles, "migrations")
}
