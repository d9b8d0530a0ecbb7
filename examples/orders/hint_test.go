package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// "is Postgres running?" is said of a database that does not answer, and
// only of it: a URL whose search_path names a schema that does not exist
// (-schema "") fails naming the schema and the fix.
func TestDatabaseHintNamesTheRealCause(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t)
	missing := s.Name + "_nope"
	c := &common{driver: "pq"}
	_, _, err := c.openPool(ctx, pgtest.WithSearchPath(s.URL, missing))
	require.Error(t, err)
	require.Contains(t, err.Error(), `schema "`+missing+`" does not exist`)
	require.Contains(t, err.Error(), `CREATE SCHEMA "`+missing+`"`)
	require.NotContains(t, err.Error(), "is Postgres running", "Postgres answered")

	refused := "postgres://postgres@" + pgconntest.Refused(t) + "/test?sslmode=disable&connect_timeout=5"
	_, _, err = c.openPool(ctx, refused)
	require.Error(t, err)
	require.Contains(t, err.Error(), "connecting (is Postgres running at -database-url?)")
	err = createSchema(ctx, refused, "x")
	require.Error(t, err)
	require.Contains(t, err.Error(), "creating schema x: connecting (is Postgres running at -database-url?)")
}
