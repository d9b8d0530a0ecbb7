package saga

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationsFS embed.FS

// Migrations returns the SQL migrations that create the saga instance and
// step history tables, for migrate.Up or `millwright migrate`. Sagas also
// need outbox.Migrations() and, for the reply handler's deduplication,
// idempotency.Migrations().
func Migrations() migrate.Source {
	return migrate.Embedded("saga", migrationsFS, "migrations")
}
