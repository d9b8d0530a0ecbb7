package idempotency

import (
	"embed"
	"io/fs"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationsFS embed.FS

// Migrations returns the SQL migrations that create the processed-events
// table, for migrate.Up or `millwright migrate`.
func Migrations() migrate.Source {
	sub, err := fs.Sub(migrationsFS, "migrations")
	if err != nil {
		// The directory is embedded at compile time; Sub cannot fail on it.
		panic("idempotency: embedded migrations missing: " + err.Error())
	}
	return migrate.Source{Component: "idempotency", FS: sub}
}
