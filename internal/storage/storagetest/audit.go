package storagetest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("audit", exerciseAudit) }

// exerciseAudit checks the audit table's operations.
func exerciseAudit(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()

	t.Run("InsertAndListNewestFirst", func(t *testing.T) {
		t.Parallel()
		p := setup(t).Pool
		ok, err := storage.AuditTableExists(ctx, p)
		require.NoError(t, err)
		require.True(t, ok)
		first, err := storage.InsertAudit(ctx, p, storage.AuditRow{User: "ann", Host: "h", Command: "millwright dlq replay",
			Args: []string{"--yes", "it's"}, Confirmed: "--yes", Affected: 3})
		require.NoError(t, err)
		second, err := storage.InsertAudit(ctx, p, storage.AuditRow{User: "bob", Host: "h", Command: "millwright outbox purge",
			DryRun: true, Confirmed: "dry-run", Error: "boom"})
		require.NoError(t, err)
		require.Greater(t, second, first)

		rows, err := storage.ListAudit(ctx, p, 0)
		require.NoError(t, err)
		require.Len(t, rows, 2)
		require.Equal(t, second, rows[0].ID, "newest first")
		require.Equal(t, "boom", rows[0].Error)
		require.True(t, rows[0].DryRun)
		require.Equal(t, []string{}, rows[0].Args, "no args is an empty array")
		require.Equal(t, []string{"--yes", "it's"}, rows[1].Args)
		require.Equal(t, "", rows[1].Error, "no error reads as empty")
		require.EqualValues(t, 3, rows[1].Affected)
		require.False(t, rows[1].At.IsZero())

		rows, err = storage.ListAudit(ctx, p, 1)
		require.NoError(t, err)
		require.Len(t, rows, 1)
		require.Equal(t, second, rows[0].ID)
	})

	t.Run("MissingTable", func(t *testing.T) {
		t.Parallel()
		p := setup(t).Pool
		_, err := p.Exec(ctx, storage.S(`DROP TABLE millwright_audit`))
		require.NoError(t, err)
		ok, err := storage.AuditTableExists(ctx, p)
		require.NoError(t, err)
		require.False(t, ok)
		_, err = storage.InsertAudit(ctx, p, storage.AuditRow{Command: "x"})
		require.Equal(t, "42P01", storage.Code(err), "%v", err)
	})
}
