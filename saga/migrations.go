package saga

import (
	"embed"
	"io/fs"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationsFS embed.FS

// Migrations returns the SQL migrations that create the saga instance and
// step history tables, for migrate.Up or `millwright migrate`. Sagas also
// need outbox.Migrations() and, for the reply handler's deduplication,
// idempotency.Migrations().
func Migrations() migrate.Source {
	sub, err := fs.Sub(migrationsFS, "migrations")
	if err != nil {
		// The directory is embedded at compile time; Sub cannot fail on it.
		panic("saga: embedded migrations missing: " + err.Error())
	}
	return migrate.Source{Component: "saga", FS: sub}
}
