package dlq

import (
	"embed"
	"io/fs"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the dlq's SQL migrations for migrate.Up. They create
// the millwright_dead_letters table in the first schema of the search_path.
func Migrations() migrate.Source {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		// fs.Sub fails only on an invalid path; "migrations" is a constant.
		panic(err)
	}
	return migrate.Source{Component: "dlq", FS: sub}
}
