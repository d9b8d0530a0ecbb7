package saga

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// A transition written against a version the row no longer has fails
// loudly (errConflict, wrapping storage.ErrConflict) and writes nothing,
// neither its history nor its commands, on every driver, at the write
// itself. The orchestrator holds the row lock, so this guards against a
// bug, not a race; it must not pass silently.
func TestCommitOfAStaleVersionFails(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), Migrations())
		pool := s.Pool(t, driver)
		type data struct{}
		def, err := Define("conflict", Step[data]{
			Name:         "one",
			Command:      func(data) (Command, error) { return Command{Topic: "one"}, nil },
			Compensation: func(data) (Command, error) { return Command{Topic: "one"}, nil },
		})
		require.NoError(t, err)
		o, err := NewOrchestrator(postgres.From(s.DB), def, Config{ReplyTopic: "conflict.replies"})
		require.NoError(t, err)
		ctx := context.Background()
		require.NoError(t, o.Start(ctx, storage.AsTx(pool), "s-1", data{}))

		load := func() instance {
			row, err := storage.LockSaga(ctx, pool, "s-1")
			require.NoError(t, err)
			return fromRow(row)
		}
		count := func(table string) int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, storage.S(`SELECT count(*) FROM `+table), &n))
			return n
		}
		before, hist, events := load(), count("millwright_saga_steps"), count("millwright_outbox")
		require.EqualValues(t, 1, before.version)
		// A transition that also sends a command: its outbox row must not
		// survive the conflict either.
		compensating := func(in instance) *transition {
			tr := &transition{in: in}
			tr.in.state = StateCompensating
			require.NoError(t, o.d.compensateFrom(tr, 0, data{}, history{loaded: true}, in.createdAt))
			require.Len(t, tr.events, 1)
			return tr
		}
		write := func(old int64, tr *transition) error {
			tx, err := pool.Begin(ctx, storage.TxOptions{})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			q := storage.NewQueue(tx)
			require.NoError(t, o.stage(ctx, q, old, tr))
			if err := q.Flush(ctx); err != nil {
				return writeError(err)
			}
			return tx.Commit(ctx)
		}

		err = write(before.version+1, compensating(before)) // stale: the row is at 1
		require.ErrorIs(t, err, errConflict)
		require.ErrorIs(t, err, storage.ErrConflict)
		require.ErrorContains(t, err, `writing saga instance s-1 over version 2`)
		after := load()
		require.Equal(t, before.version, after.version)
		require.Equal(t, StateRunning, after.state)
		require.Equal(t, hist, count("millwright_saga_steps"), "no history written")
		require.Equal(t, events, count("millwright_outbox"), "no command written")

		// The right version commits.
		require.NoError(t, write(before.version, compensating(before)))
		after = load()
		require.EqualValues(t, before.version+1, after.version)
		require.Equal(t, StateCompensating, after.state)
		require.Equal(t, hist+1, count("millwright_saga_steps"))
		require.Equal(t, events+1, count("millwright_outbox"))
	})
}
