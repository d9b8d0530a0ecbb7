package main

import (
	"fmt"
	"os"
	"regexp"
	"strings"

	_ "github.com/lib/pq" // registers the "postgres" driver
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// envSchema names the Postgres schema of millwright's tables when --schema
// is not given.
const envSchema = "MILLWRIGHT_SCHEMA"

// addSchemaFlag adds --schema, persistent, so that every command below
// cmd takes it: `millwright --schema s outbox status` and `millwright
// outbox status --schema s` both work.
func addSchemaFlag(cmd *cobra.Command) {
	cmd.PersistentFlags().String("schema", "", "Postgres schema of millwright's tables (default $"+envSchema+", else the database URL's search_path, normally public): a plain identifier of at most 63 bytes, folded to lower case as Postgres folds unquoted names; migrate creates it.")
}

var schemaRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// schemaOf returns the schema the command works in: --schema, else
// $MILLWRIGHT_SCHEMA, else "" (the URL's search_path).
func schemaOf(cmd *cobra.Command) (string, error) { return schemaFrom(cmd, os.LookupEnv) }

// schemaFrom is schemaOf with the environment read through lookup.
func schemaFrom(cmd *cobra.Command, lookup func(string) (string, bool)) (string, error) {
	s := ""
	if f := cmd.Flags().Lookup("schema"); f != nil && f.Changed {
		s = f.Value.String()
	} else if v, ok := lookup(envSchema); ok {
		s = v
	}
	s = strings.TrimSpace(s)
	if s != "" && !schemaRe.MatchString(s) {
		return "", fmt.Errorf("schema %q (--schema or $%s): want a plain Postgres identifier: a letter or _, then letters, digits or _, at most 63 bytes", s, envSchema)
	}
	// The name goes unquoted into search_path, where Postgres folds it to
	// lower case: fold it here too, so that migrate creates the schema the
	// search_path names.
	return strings.ToLower(s), nil
}

// withSchema returns rawURL with its search_path set to schema ("" leaves
// it as it is).
func withSchema(rawURL, schema string) string {
	if schema == "" {
		return rawURL
	}
	return pgtest.WithSearchPath(rawURL, schema)
}
