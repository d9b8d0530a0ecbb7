package storagetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("console", exerciseConsole) }

// exerciseConsole checks the operator console's operations.
func exerciseConsole(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(*testing.T, Setup)
	}{
		{"SchemasAndSearchPath", consoleSchemasAndSearchPath},
		{"GroupsAndTake", consoleGroupsAndTake},
		{"OutboxLanesRelaysBacklogAndSagas", consoleOutboxAndSagas},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t))
		})
	}
}

func consoleSchemasAndSearchPath(t *testing.T, st Setup) {
	ctx := context.Background()
	schemas, err := storage.ListConsoleSchemas(ctx, st.Pool)
	require.NoError(t, err)
	require.Contains(t, schemas, st.Schema.Name)
	tables, err := storage.ConsoleTablesIn(ctx, st.Pool)
	require.NoError(t, err)
	for _, n := range storage.ConsoleTables {
		require.True(t, tables[n], n)
	}

	// A transaction pointed at a schema with a hostile name reads that
	// schema (quoted by the server), not the pool's.
	odd := `Odd "name"; DROP`
	require.NoError(t, storage.CreateSchema(ctx, st.Pool, odd, false))
	t.Cleanup(func() { _ = storage.DropSchema(context.Background(), st.Pool, odd) })
	tx, err := st.Pool.Begin(ctx, storage.TxOptions{ReadOnly: true, First: []storage.Statement{storage.SetLocalSearchPath(odd)}})
	require.NoError(t, err)
	var current string
	require.NoError(t, tx.QueryRow(ctx, storage.S(`SELECT current_schema()::text`), &current))
	require.Equal(t, odd, current)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, st.Pool.QueryRow(ctx, storage.S(`SELECT current_schema()::text`), &current))
	require.Equal(t, st.Schema.Name, current, "SET LOCAL: the pool's connections keep their search_path")
}

func consoleGroupsAndTake(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	first := dlInsert(t, p, dlRow("u1", "orders", "boom 1", dlAt.Add(time.Second)))
	second := dlInsert(t, p, dlRow("u2", "orders", "boom 2", dlAt.Add(2*time.Second)))
	other := dlRow("u3", "orders", "bad json", dlAt.Add(3*time.Second))
	other.ErrorType = "*json.SyntaxError"
	dlInsert(t, p, other)

	groups, err := storage.GroupDeadLetters(ctx, p, storage.DeadLetterFilter{})
	require.NoError(t, err)
	require.Len(t, groups, 2)
	require.Equal(t, storage.DeadLetterGroup{Topic: "orders", ErrorType: "*errors.errorString", Count: 2, Dead: 2,
		FirstSeen: dlAt, LastSeen: dlAt.Add(2 * time.Second), SampleError: "boom 2"}, utcGroup(groups[0]), "the largest group first, its newest error")
	rows, err := storage.ListDeadLetters(ctx, p, storage.DeadLetterFilter{ErrorType: "*json.SyntaxError"})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	require.Equal(t, "dead", rows[0].State)

	// Taking a row out of 'dead' succeeds once; the second attempt is a
	// conflict and leaves its transaction's other writes uncommitted.
	require.NoError(t, storage.TakeDeadLetter(ctx, p, first, "superseded", "evt-2", "alice"))
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	err = storage.TakeDeadLetter(ctx, tx, first, "replayed", "", "bob")
	require.True(t, errors.Is(err, storage.ErrConflict), "%v", err)
	require.NoError(t, tx.Rollback(ctx))
	got, err := storage.GetDeadLetter(ctx, p, first)
	require.NoError(t, err)
	require.Equal(t, []string{"superseded", "evt-2", "alice"}, []string{got.State, got.SupersededBy, got.SupersededActor})
	require.NotNil(t, got.ReplayedAt, "a superseded row is no longer pending")

	// The replay's lock skips a superseded row even when forced, and its
	// mark makes a row 'replayed'.
	_, ok, err := storage.LockDeadLetterForReplay(ctx, p, first, true)
	require.NoError(t, err)
	require.False(t, ok, "a superseded row is never replayed")
	require.NoError(t, storage.MarkDeadLetterReplayed(ctx, p, second))
	got, err = storage.GetDeadLetter(ctx, p, second)
	require.NoError(t, err)
	require.Equal(t, "replayed", got.State)
	require.ErrorIs(t, storage.TakeDeadLetter(ctx, p, second, "superseded", "x", "carol"), storage.ErrConflict)
}

func utcGroup(g storage.DeadLetterGroup) storage.DeadLetterGroup {
	g.FirstSeen, g.LastSeen = g.FirstSeen.UTC(), g.LastSeen.UTC()
	return g
}

func consoleOutboxAndSagas(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	lanes, err := storage.ReadOutboxLanes(ctx, p)
	require.NoError(t, err)
	require.Len(t, lanes, 64)
	require.True(t, lanes[0].LeaseUntil.IsZero() && !lanes[0].Held, "a lane never leased (-infinity) reads as the zero time")
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_outbox_lanes SET owner = 'r1', lease_until = now() + interval '1 minute', lent = lane = 5 WHERE lane IN (3, 5)`))
	require.NoError(t, err)
	_, err = p.Exec(ctx, storage.S(`INSERT INTO millwright_outbox_relays (id, seen_until, load) VALUES ('r1', now() + interval '1 minute', 'full')`))
	require.NoError(t, err)
	lanes, err = storage.ReadOutboxLanes(ctx, p)
	require.NoError(t, err)
	require.Equal(t, []any{"r1", true, false}, []any{lanes[3].Owner, lanes[3].Held, lanes[3].Lent})
	require.True(t, lanes[5].Lent)
	relays, err := storage.ReadOutboxRelays(ctx, p)
	require.NoError(t, err)
	require.Len(t, relays, 1)
	require.Equal(t, []any{"r1", "full", true}, []any{relays[0].ID, relays[0].Load, relays[0].Live})

	_, err = p.Exec(ctx, storage.S(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count)
		VALUES ('a', 't', 'a', '{}', 'pending', 0), ('b', 't', 'b', '{}', 'pending', 3), ('c', 't', 'c', '{}', 'failed', 9), ('d', 'u', 'd', '{}', 'published', 0)`))
	require.NoError(t, err)
	backlog, err := storage.ReadOutboxBacklog(ctx, p)
	require.NoError(t, err)
	require.Len(t, backlog, 1, "published rows are not backlog")
	require.Equal(t, []any{"t", int64(2), int64(1), int64(1)}, []any{backlog[0].Topic, backlog[0].Pending, backlog[0].Retrying, backlog[0].Failed})

	for _, id := range []string{"s1", "s2"} {
		_, err := storage.InsertSaga(ctx, p, storage.SagaInstance{ID: id, Type: "transfer", State: "stuck", Data: []byte(`{}`)},
			[]storage.SagaStep{{Step: "debit", Kind: "command", Attempt: 1}})
		require.NoError(t, err)
	}
	sum, err := storage.SummarizeSagas(ctx, p)
	require.NoError(t, err)
	require.Len(t, sum, 1)
	require.Equal(t, []any{"transfer", "stuck", int64(2)}, []any{sum[0].Type, sum[0].State, sum[0].Count})
}
