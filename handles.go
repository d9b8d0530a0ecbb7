package millwright

import (
	"database/sql"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/postgres"
)

// onPool calls a component's constructor with the pool db holds. The
// constructors are generic over postgres.Pool today; when they take a
// postgres.DB this helper goes and the client passes db to them.
func onPool[T any](db postgres.DB, withPgx func(*pgxpool.Pool) (T, error), withSQL func(*sql.DB) (T, error)) (T, error) {
	if p := db.Pgx(); p != nil {
		return withPgx(p)
	}
	return withSQL(db.SQL())
}
