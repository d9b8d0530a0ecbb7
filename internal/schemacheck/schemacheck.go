// Package schemacheck checks, when a long-running component starts, that
// the tables it works on exist in its database's search_path, so that a
// service whose migrations never ran (or that points at the wrong schema)
// fails at start with the fix, instead of logging the same error every
// round. The outbox relay, the saga orchestrator, the cleaners and
// `millwright relay` use it.
package schemacheck

import (
	"context"
	"fmt"
	"strings"

	"github.com/millwright/millwright/internal/storage"
)

// MissingError is returned by Check when the database answered and some
// tables are not in the search_path.
type MissingError struct {
	// Component names who needs the tables ("outbox relay").
	Component string
	// Missing are the tables not found, in the order asked.
	Missing []string
	// Schema is current_schema() ("" when no schema of the search_path
	// exists), SearchPath the session's search_path setting.
	Schema, SearchPath string
}

func (e *MissingError) Error() string {
	schema := fmt.Sprintf("schema %q", e.Schema)
	if e.Schema == "" {
		schema = "no schema of it exists"
	}
	return fmt.Sprintf("%s: no %s in the search_path (%s; %s): did `millwright migrate` run on this database? "+
		"Run `millwright migrate` with the service's database URL, or set search_path in that URL to the schema it migrated",
		e.Component, strings.Join(e.Missing, ", "), e.SearchPath, schema)
}

// Check reports whether tables (unqualified names) all exist in the
// search_path of db: nil when they do, a *MissingError naming those that
// do not when the database answered, and another error (wrapped, naming
// the component) when it could not be asked, e.g. it is unreachable: a
// caller retries that one and fails on a *MissingError.
//
// db is a storage.Querier (a storage.Pool, Tx or Session), or anything
// storage.From resolves to one: a *sql.DB, *sql.Conn, *sql.Tx, pgx.Tx,
// *pgx.Conn or *pgxpool.Pool.
func Check(ctx context.Context, db any, component string, tables ...string) error {
	q, err := storage.From(db)
	if err != nil {
		return fmt.Errorf("%s: looking for its tables (%s): %w", component, strings.Join(tables, ", "), err)
	}
	info, err := storage.LookupTables(ctx, q, tables...)
	if err != nil {
		return fmt.Errorf("%s: looking for its tables (%s): %w", component, strings.Join(tables, ", "), err)
	}
	if len(info.Missing) == 0 {
		return nil
	}
	return &MissingError{Component: component, Missing: info.Missing, Schema: info.Schema, SearchPath: info.SearchPath}
}
