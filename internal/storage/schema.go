package storage

import (
	"context"
	"strings"
)

// SchemaInfo is what LookupTables finds: the session's schema and
// search_path, and the tables asked for that are not on it.
type SchemaInfo struct {
	// Schema is current_schema() ("" when no schema of the search_path
	// exists), SearchPath the session's search_path setting.
	Schema, SearchPath string
	// Missing are the tables not found, in the order asked.
	Missing []string
}

// lookupTables: one round trip, no parameter of a driver-specific type
// (the names hold no comma).
const lookupTables = `SELECT coalesce(current_schema(), ''), current_setting('search_path'),
		coalesce(array_to_string(array(SELECT t FROM unnest(string_to_array($1::text, ',')) WITH ORDINALITY u(t, i)
			WHERE to_regclass(t) IS NULL ORDER BY i), ','), '')`

// LookupTables looks up tables (unqualified names, without commas) on
// q's search_path, in one statement.
func LookupTables(ctx context.Context, q Querier, tables ...string) (SchemaInfo, error) {
	var info SchemaInfo
	var missing string
	err := q.QueryRow(ctx, S(lookupTables, strings.Join(tables, ",")), &info.Schema, &info.SearchPath, &missing)
	if err != nil {
		return SchemaInfo{}, err
	}
	if missing != "" {
		info.Missing = strings.Split(missing, ",")
	}
	return info, nil
}

// CurrentSchema returns the session's current_schema() ("" when no schema
// of its search_path exists) and its search_path setting.
func CurrentSchema(ctx context.Context, q Querier) (schema, searchPath string, err error) {
	info, err := LookupTables(ctx, q)
	return info.Schema, info.SearchPath, err
}
