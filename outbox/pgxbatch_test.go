package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
)

// AddToBatch's events travel in the caller's pgx.Batch: committed with the
// business row, rolled back with it, refused before anything is queued
// when invalid, and a server error is the batch's.
func TestAddToBatchTravelsWithTheBusinessStatements(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, outbox.Migrations())
	pool := s.Pgx(t)
	_, err := pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY)`)
	require.NoError(t, err)

	write := func(id string, commit bool) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO orders VALUES ($1)`, id)
		require.NoError(t, outbox.AddToBatch(ctx, b, outbox.Event{Topic: "orders", AggregateID: id, Payload: []byte(`{"id":"` + id + `"}`)}))
		require.Equal(t, 2, b.Len())
		require.NoError(t, tx.SendBatch(ctx, b).Close())
		if commit {
			require.NoError(t, tx.Commit(ctx))
		}
	}
	write("o-1", true)
	write("o-2", false)
	events := pgtest.Column[string](t, s.DB, `SELECT aggregate_id FROM millwright_outbox ORDER BY id`)
	require.Equal(t, []string{"o-1"}, events, "the committed transaction's event only")
	orders := pgtest.Column[string](t, s.DB, `SELECT id FROM orders ORDER BY id`)
	require.Equal(t, []string{"o-1"}, orders)

	b := &pgx.Batch{}
	err = outbox.AddToBatch(ctx, b, outbox.Event{Topic: ""})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.Zero(t, b.Len(), "an invalid event queues nothing")

	// A schema without the outbox table: the batch's results say so.
	bare := pgtest.New(t)
	bp := bare.Pgx(t)
	b = &pgx.Batch{}
	require.NoError(t, outbox.AddToBatch(ctx, b, outbox.Event{Topic: "orders", Payload: []byte(`{}`)}))
	err = bp.SendBatch(ctx, b).Close()
	require.Error(t, err)
	require.Contains(t, err.Error(), "millwright_outbox")
}
