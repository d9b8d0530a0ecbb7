package saga

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/outbox"
)

// A transition written against a version the row no longer has fails
// loudly and writes nothing: at once (errConflict) on lib/pq's own pool,
// at COMMIT on a pool of postgres.Open, where the statement travels with
// it. The orchestrator holds the row lock, so this guards against a bug,
// not a race; it must not pass silently either way.
func TestCommitOfAStaleVersionFails(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), Migrations())
	deferring, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = deferring.Close() })
	type data struct{}
	def, err := Define("conflict", Step[data]{
		Name:         "one",
		Command:      func(data) (Command, error) { return Command{Topic: "one"}, nil },
		Compensation: func(data) (Command, error) { return Command{Topic: "one"}, nil },
	})
	require.NoError(t, err)
	o, err := NewOrchestrator(s.DB, def, Config{ReplyTopic: "conflict.replies"})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, o.Start(ctx, s.DB, "s-1", data{}))

	load := func(db *sql.DB) instance {
		in, err := scanInstance(db.QueryRowContext(ctx, `SELECT `+instanceColumns+` FROM millwright_saga_instances WHERE id = 's-1'`))
		require.NoError(t, err)
		return in
	}
	steps := func() int {
		var n int
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT count(*) FROM millwright_saga_steps WHERE saga_id = 's-1'`).Scan(&n))
		return n
	}
	before, history := load(s.DB), steps()
	require.EqualValues(t, 1, before.version)
	transition := func() *transition {
		tr := &transition{in: before}
		tr.in.state = StateCompleted
		tr.record("one", KindCompleted, "", 0, "")
		return tr
	}

	for _, db := range []*sql.DB{s.DB, deferring} {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		err = o.commit(ctx, tx, before.version+1, transition()) // stale: the row is at 1
		if db == s.DB {
			require.ErrorIs(t, err, errConflict)
			require.ErrorContains(t, err, `instance "s-1" is no longer at version 2`)
			require.NoError(t, tx.Rollback())
		} else {
			require.NoError(t, err, "deferred to COMMIT")
			err = tx.Commit()
			require.ErrorContains(t, err, conflictMessage)
			require.ErrorContains(t, err, "nothing committed")
		}
		after := load(s.DB)
		require.Equal(t, before.version, after.version)
		require.Equal(t, StateRunning, after.state)
		require.Equal(t, history, steps(), "no history written")
	}

	// The right version commits, on both pools.
	for i, db := range []*sql.DB{s.DB, deferring} {
		cur := load(s.DB)
		tr := transition()
		tr.in = cur
		tr.in.state = StateCompleted
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, o.commit(ctx, tx, cur.version, tr))
		require.NoError(t, tx.Commit())
		require.EqualValues(t, before.version+int64(i)+1, load(s.DB).version)
		require.Equal(t, history+i+1, steps())
	}
}
