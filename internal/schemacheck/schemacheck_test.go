package schemacheck_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/schemacheck"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

func TestCheck_NamesTheMissingTablesAndTheFix(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()
	_, err := s.DB.ExecContext(ctx, `CREATE TABLE present (id int)`)
	require.NoError(t, err)

	require.NoError(t, schemacheck.Check(ctx, s.DB, "thing", "present"))

	err = schemacheck.Check(ctx, s.DB, "thing", "present", "absent_a", "absent_b")
	var me *schemacheck.MissingError
	require.True(t, errors.As(err, &me), "want a *MissingError, got %v", err)
	require.Equal(t, []string{"absent_a", "absent_b"}, me.Missing)
	require.Equal(t, s.Name, me.Schema)
	for _, want := range []string{"thing:", "absent_a, absent_b", "millwright migrate", s.Name, "search_path"} {
		require.ErrorContains(t, err, want)
	}
}

func TestCheck_UnreachableIsNotMissing(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := schemacheck.Check(ctx, s.DB, "thing", "present")
	require.Error(t, err)
	var me *schemacheck.MissingError
	require.False(t, errors.As(err, &me), "a failed query is not a missing table: %v", err)
}
