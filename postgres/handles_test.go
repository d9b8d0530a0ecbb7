package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

func TestZeroHandlesAreRefusedWithTheFix(t *testing.T) {
	t.Parallel()
	require.ErrorIs(t, postgres.DB{}.Valid(), postgres.ErrNoDB)
	require.ErrorContains(t, postgres.DB{}.Valid(), "postgres.From(pool)")
	require.ErrorIs(t, postgres.SQL(nil).Valid(), postgres.ErrNoDB)
	require.ErrorIs(t, postgres.Pgx(nil).Valid(), postgres.ErrNoDB)
	require.ErrorIs(t, postgres.Tx{}.Valid(), postgres.ErrNoDB)
	require.ErrorIs(t, postgres.DB{}.PingContext(context.Background()), postgres.ErrNoDB)
	require.ErrorIs(t, postgres.DB{}.InTx(context.Background(), func(postgres.Tx) error { return nil }), postgres.ErrNoDB)
}

func TestInTxCommitsOrRollsBackOnBothDrivers(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		s := pgtest.New(t)
		db := s.Handles(t, driver)
		require.Equal(t, driver == pgtest.DriverPgx, db.Pgx() != nil)
		require.NoError(t, db.PingContext(ctx))
		_, err := s.DB.ExecContext(ctx, `CREATE TABLE t (v text)`)
		require.NoError(t, err)
		insert := func(v string) func(postgres.Tx) error {
			return func(tx postgres.Tx) error {
				require.NoError(t, tx.Valid())
				if tx.Pgx() != nil {
					_, err := tx.Pgx().Exec(ctx, `INSERT INTO t VALUES ($1)`, v)
					return err
				}
				_, err := tx.SQL().ExecContext(ctx, `INSERT INTO t VALUES ($1)`, v)
				return err
			}
		}
		require.NoError(t, db.InTx(ctx, insert("kept")))
		boom := errors.New("boom")
		require.ErrorIs(t, db.InTx(ctx, func(tx postgres.Tx) error {
			require.NoError(t, insert("dropped")(tx))
			return boom
		}), boom)
		require.PanicsWithValue(t, "panicked", func() {
			_ = db.InTx(ctx, func(tx postgres.Tx) error {
				require.NoError(t, insert("panicked")(tx))
				panic("panicked")
			})
		})
		require.Equal(t, []string{"kept"}, pgtest.Column[string](t, s.DB, `SELECT v FROM t ORDER BY v`))
	})
}
