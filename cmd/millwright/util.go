package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"

	_ "github.com/lib/pq" // registers the "postgres" driver

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/internal/redact"
)

// defaultDatabaseURL is the local development server.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL(flag string) string {
	if flag != "" {
		return flag
	}
	if u := os.Getenv("MILLWRIGHT_DATABASE_URL"); u != "" {
		return u
	}
	return defaultDatabaseURL
}

// scratchSchema creates a throw-away schema named prefix_<random> through
// admin, on the server base reaches. It returns the schema, a URL like base
// whose search_path points at it, and a function that drops it.
func scratchSchema(ctx context.Context, admin *sql.DB, base, prefix string) (schema, schemaURL string, drop func(), err error) {
	var b [5]byte
	_, _ = rand.Read(b[:])
	schema = prefix + "_" + hex.EncodeToString(b[:])
	if _, err := admin.ExecContext(ctx, `CREATE SCHEMA `+schema); err != nil {
		return "", "", nil, fmt.Errorf("creating scratch schema %s on %s: %w", schema, redact.URL(base), err)
	}
	return schema, pgtest.WithSearchPath(base, schema), func() {
		_, _ = admin.ExecContext(context.WithoutCancel(ctx), `DROP SCHEMA `+schema+` CASCADE`)
	}, nil
}
