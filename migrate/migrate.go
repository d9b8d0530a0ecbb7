package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/millwright/millwright/postgres"
)

// Source is one component's migrations.
type Source struct {
	// Component names the component ("outbox"); it scopes the version numbers.
	Component string
	// FS holds files named NNN_description.sql at its root.
	FS fs.FS
}

// Embedded returns the Source of component whose migrations are the files
// in directory dir of fsys, normally a //go:embed dir/*.sql file system. A
// dir that is not a valid path (fs.Sub's only failure) is a programming
// error: Embedded panics, naming the component.
func Embedded(component string, fsys fs.FS, dir string) Source {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(component + ": embedded migrations missing: " + err.Error())
	}
	return Source{Component: component, FS: sub}
}

// Migration is one parsed migration file.
type Migration struct {
	Component string
	Version   int
	Name      string
	SQL       string
}

// Applied reports a migration that Up applied.
type Applied struct {
	Component string
	Version   int
	Name      string
}

// ErrNoSchema is matched (errors.Is) by a *NoSchemaError.
var ErrNoSchema = errors.New("migrate: no schema of the search_path exists")

// NoSchemaError is Up's error when no schema of the connection's
// search_path exists, so there is no schema to create the tables in: the
// schema was never created, or the search_path names the wrong one.
type NoSchemaError struct {
	// SearchPath is the connection's search_path setting.
	SearchPath string
	// Schemas are the schemas it names ("$user" left out unless alone).
	Schemas []string
}

func (e *NoSchemaError) Error() string {
	quoted := make([]string, len(e.Schemas))
	for i, s := range e.Schemas {
		quoted[i] = strconv.Quote(s)
	}
	switch len(e.Schemas) {
	case 0:
		return fmt.Sprintf("migrate: the connection's search_path (%q) names no schema to create the tables in: "+
			"set search_path (in the database URL) to the schema to migrate, and create it (CREATE SCHEMA ...)", e.SearchPath)
	case 1:
		return fmt.Sprintf("migrate: schema %s does not exist (the connection's search_path is %q): "+
			"create it (CREATE SCHEMA %s), or connect with a search_path naming the schema to migrate",
			quoted[0], e.SearchPath, quoteIdent(e.Schemas[0]))
	}
	return fmt.Sprintf("migrate: none of the schemas of the connection's search_path (%q) exists: "+
		"create the one to migrate (CREATE SCHEMA %s), or connect with a search_path naming an existing schema",
		e.SearchPath, quoteIdent(e.Schemas[0]))
}

// Is makes errors.Is(err, ErrNoSchema) hold.
func (e *NoSchemaError) Is(target error) bool { return target == ErrNoSchema }

// searchPathSchemas splits a search_path setting into its schema names,
// unquoted; "$user" is left out unless it is the only one.
func searchPathSchemas(path string) []string {
	var out []string
	user := false
	for _, part := range splitSearchPath(path) {
		if part == "$user" {
			user = true
			continue
		}
		out = append(out, part)
	}
	if len(out) == 0 && user {
		out = []string{"$user"}
	}
	return out
}

// splitSearchPath splits on the commas outside double quotes, trims
// spaces and unquotes each name.
func splitSearchPath(path string) []string {
	var out []string
	var cur strings.Builder
	inQuotes, quoted := false, false
	flush := func() {
		name := cur.String()
		if !quoted {
			name = strings.TrimSpace(name)
		}
		if name != "" {
			out = append(out, name)
		}
		cur.Reset()
		quoted = false
	}
	for i := 0; i < len(path); i++ {
		c := path[i]
		switch {
		case c == '"' && inQuotes && i+1 < len(path) && path[i+1] == '"':
			cur.WriteByte('"')
			i++
		case c == '"':
			inQuotes = !inQuotes
			quoted = true
		case c == ',' && !inQuotes:
			flush()
		case (c == ' ' || c == '\t') && !inQuotes:
		default:
			cur.WriteByte(c)
		}
	}
	flush()
	return out
}

// quoteIdent quotes a schema name for the CREATE SCHEMA of an error.
func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// lockKey is the advisory lock key taken while migrating ("millwrig" in ASCII).
const lockKey int64 = 0x6d696c6c77726967

var fileRe = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.sql$`)

// Load parses the migrations of one source, sorted by version.
func Load(src Source) ([]Migration, error) {
	if src.Component == "" {
		return nil, errors.New("migrate: source has an empty Component name")
	}
	entries, err := fs.ReadDir(src.FS, ".")
	if err != nil {
		return nil, fmt.Errorf("migrate: reading migrations of %s: %w", src.Component, err)
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		if e.IsDir() || path.Ext(e.Name()) != ".sql" {
			continue
		}
		m := fileRe.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migrate: %s: file %q is not named NNN_description.sql", src.Component, e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrate: %s: version %d used by both %q and %q", src.Component, v, prev, e.Name())
		}
		seen[v] = e.Name()
		body, err := fs.ReadFile(src.FS, e.Name())
		if err != nil {
			return nil, fmt.Errorf("migrate: reading %s/%s: %w", src.Component, e.Name(), err)
		}
		out = append(out, Migration{Component: src.Component, Version: v, Name: m[2], SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// loadAll loads every source's migrations, each source in version order.
func loadAll(sources []Source) ([]Migration, error) {
	var all []Migration
	for _, src := range sources {
		ms, err := Load(src)
		if err != nil {
			return nil, err
		}
		all = append(all, ms...)
	}
	return all, nil
}

// recorded reads the versions millwright_migrations records per component.
func recorded(ctx context.Context, q interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}) (map[string]map[int]bool, error) {
	done := map[string]map[int]bool{}
	rows, err := q.QueryContext(ctx, `SELECT component, version FROM millwright_migrations`)
	if err != nil {
		return nil, fmt.Errorf("migrate: reading millwright_migrations: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var c string
		var v int
		if err := rows.Scan(&c, &v); err != nil {
			return nil, fmt.Errorf("migrate: reading millwright_migrations: %w", err)
		}
		if done[c] == nil {
			done[c] = map[int]bool{}
		}
		done[c][v] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("migrate: reading millwright_migrations: %w", err)
	}
	return done, nil
}

// Pending returns the migrations of the given sources that Up would apply
// now, in the order it would apply them, without changing anything (it
// takes no lock and creates no table: a database never migrated has every
// migration pending).
func Pending(ctx context.Context, pdb postgres.DB, sources ...Source) ([]Migration, error) {
	all, err := loadAll(sources)
	if err != nil {
		return nil, err
	}
	db, closeDB, err := sqlDB(pdb)
	if err != nil {
		return nil, err
	}
	defer closeDB()
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('millwright_migrations') IS NOT NULL`).Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrate: looking for millwright_migrations: %w", err)
	}
	done := map[string]map[int]bool{}
	if exists {
		if done, err = recorded(ctx, db); err != nil {
			return nil, err
		}
	}
	var pending []Migration
	for _, m := range all {
		if !done[m.Component][m.Version] {
			pending = append(pending, m)
		}
	}
	return pending, nil
}

// Up applies every pending migration of the given sources, in order.
func Up(ctx context.Context, pdb postgres.DB, sources ...Source) ([]Applied, error) {
	all, err := loadAll(sources)
	if err != nil {
		return nil, err
	}
	db, closeDB, err := sqlDB(pdb)
	if err != nil {
		return nil, err
	}
	defer closeDB()

	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: connecting: %w", err)
	}
	defer conn.Close()

	// Tables are created in current_schema(), the first schema of the
	// search_path that exists. With none, Postgres' own error ("no schema
	// has been selected to create in") names no schema.
	var current sql.NullString
	var searchPath string
	if err := conn.QueryRowContext(ctx, `SELECT current_schema(), current_setting('search_path')`).Scan(&current, &searchPath); err != nil {
		return nil, fmt.Errorf("migrate: reading the connection's schema: %w", err)
	}
	if !current.Valid {
		return nil, &NoSchemaError{SearchPath: searchPath, Schemas: searchPathSchemas(searchPath)}
	}

	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
		return nil, fmt.Errorf("migrate: taking advisory lock: %w", err)
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, lockKey) //nolint:errcheck // released with the session anyway

	if _, err := conn.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS millwright_migrations (
		component  TEXT        NOT NULL,
		version    INT         NOT NULL,
		name       TEXT        NOT NULL,
		applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
		PRIMARY KEY (component, version)
	)`); err != nil {
		return nil, fmt.Errorf("migrate: creating millwright_migrations: %w", err)
	}

	done, err := recorded(ctx, conn)
	if err != nil {
		return nil, err
	}

	var applied []Applied
	for _, m := range all {
		if done[m.Component][m.Version] {
			continue
		}
		if err := apply(ctx, conn, m); err != nil {
			return applied, err
		}
		applied = append(applied, Applied{Component: m.Component, Version: m.Version, Name: m.Name})
	}
	return applied, nil
}

// sqlDB returns db as a *sql.DB: its own, or one over its pgx pool
// (pgx's stdlib adapter, closed by the returned func without closing the
// pool).
func sqlDB(db postgres.DB) (*sql.DB, func(), error) {
	if err := db.Valid(); err != nil {
		return nil, nil, fmt.Errorf("migrate: %w", err)
	}
	if db.SQL() != nil {
		return db.SQL(), func() {}, nil
	}
	s := stdlib.OpenDBFromPool(db.Pgx())
	return s, func() { _ = s.Close() }, nil
}

func apply(ctx context.Context, conn *sql.Conn, m Migration) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("migrate: %s %03d_%s: begin: %w", m.Component, m.Version, m.Name, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	if _, err := tx.ExecContext(ctx, m.SQL); err != nil {
		return fmt.Errorf("migrate: %s %03d_%s: %w", m.Component, m.Version, m.Name, err)
	}
	if _, err := tx.ExecContext(ctx,
		`INSERT INTO millwright_migrations (component, version, name) VALUES ($1, $2, $3)`,
		m.Component, m.Version, m.Name); err != nil {
		return fmt.Errorf("migrate: recording %s %03d_%s: %w", m.Component, m.Version, m.Name, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migrate: %s %03d_%s: commit: %w", m.Component, m.Version, m.Name, err)
	}
	return nil
}
