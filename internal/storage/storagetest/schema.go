package storagetest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("schema", exerciseSchema) }

// exerciseSchema checks LookupTables, which schemacheck uses.
func exerciseSchema(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	t.Run("LookupTables", func(t *testing.T) {
		t.Parallel()
		s := setup(t)
		info, err := storage.LookupTables(ctx, s.Pool, "millwright_outbox", "absent_b", "millwright_audit", "absent_a")
		require.NoError(t, err)
		require.Equal(t, []string{"absent_b", "absent_a"}, info.Missing, "in the order asked")
		require.Equal(t, s.Schema.Name, info.Schema)
		require.Contains(t, info.SearchPath, s.Schema.Name)
		info, err = storage.LookupTables(ctx, s.Pool, "millwright_outbox")
		require.NoError(t, err)
		require.Empty(t, info.Missing)
		schema, path, err := storage.CurrentSchema(ctx, s.Pool)
		require.NoError(t, err)
		require.Equal(t, s.Schema.Name, schema)
		require.Equal(t, info.SearchPath, path)
	})
}
