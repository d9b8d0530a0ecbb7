package storagetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("wire", exerciseWire) }

// exerciseWire checks the driver primitives every operation relies on.
func exerciseWire(t *testing.T, setup func(t *testing.T) Setup) {
	t.Run("ArgumentsRoundTrip", func(t *testing.T) { wireArgumentsRoundTrip(t, setup) })

	t.Run("NullsAndNoRows", func(t *testing.T) { wireNullsAndNoRows(t, setup) })

	t.Run("BatchIsAtomicAndNamesTheFailure", func(t *testing.T) { wireBatchIsAtomicAndNamesTheFailure(t, setup) })

	t.Run("ExpectStopsTheBatchOnTheServer", func(t *testing.T) { wireExpectStopsTheBatchOnTheServer(t, setup) })

	t.Run("BeginCarriesFirstStatements", func(t *testing.T) { wireBeginCarriesFirstStatements(t, setup) })

	t.Run("TxCommitsAndHandsItsHandle", func(t *testing.T) { wireTxCommitsAndHandsItsHandle(t, setup) })

	t.Run("QueueSendsAtFlush", func(t *testing.T) { wireQueueSendsAtFlush(t, setup) })

	t.Run("CancelledContext", func(t *testing.T) { wireCancelledContext(t, setup) })
}

// wireTable is a pool on a fresh schema with table w, a column of every
// argument type.
func wireTable(t *testing.T, setup func(t *testing.T) Setup) storage.Pool {
	s := setup(t)
	_, err := s.Pool.Exec(context.Background(), storage.S(`CREATE TABLE w (id bigint PRIMARY KEY, s text, b bytea, ok bool, at timestamptz, f float8, j jsonb, ids bigint[], names text[])`))
	require.NoError(t, err)
	return s.Pool
}

func wireArgumentsRoundTrip(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	at := time.Date(2026, 12, 3, 10, 4, 5, 123456000, time.UTC)
	hostile := "it's \\ a 'quoted' $1 -- not a comment /* nor this */ $$dollar$$ é"
	n, err := p.Exec(ctx, storage.S(`INSERT INTO w VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		int64(1), hostile, []byte{0, 1, '\'', 0xff}, true, at, 1.5, `{"a": "x'y"}`, []int64{3, 1, 2}, []string{"a'b", `c\d`}))
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	var (
		s     string
		b     []byte
		ok    bool
		got   time.Time
		f     float64
		j     string
		ids   []int64
		names []string
	)
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT s, b, ok, at, f, j::text, ids, names FROM w WHERE id = $1 AND s = $2`, 1, hostile),
		&s, &b, &ok, &got, &f, &j, storage.Array(&ids), storage.Array(&names)))
	require.Equal(t, hostile, s)
	require.Equal(t, []byte{0, 1, '\'', 0xff}, b)
	require.True(t, ok)
	require.True(t, at.Equal(got), "at %v, got %v", at, got)
	require.Equal(t, 1.5, f)
	require.JSONEq(t, `{"a": "x'y"}`, j)
	require.Equal(t, []int64{3, 1, 2}, ids)
	require.Equal(t, []string{"a'b", `c\d`}, names)
}

func wireNullsAndNoRows(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, s, b) VALUES ($1, $2, $3)`, 2, nil, []byte(nil)))
	require.NoError(t, err)
	var s *string
	var b []byte
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT s, b FROM w WHERE id = $1`, 2), &s, &b))
	require.Nil(t, s)
	require.Nil(t, b)
	err = p.QueryRow(ctx, storage.S(`SELECT s FROM w WHERE id = $1`, 99), &s)
	require.True(t, storage.IsNoRows(err), "no row: %v", err)
}

func wireBatchIsAtomicAndNamesTheFailure(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	err := p.Batch(ctx,
		storage.S(`INSERT INTO w (id) VALUES ($1)`, 10),
		storage.Statement{SQL: `INSERT INTO w (id) VALUES ($1)`, Args: []any{10}, Expect: storage.NoExpect, What: "the duplicate"})
	var be *storage.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, "23505", storage.Code(err), "unique violation: %v", err)
	require.Contains(t, err.Error(), "the duplicate")
	var n int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w`), &n))
	require.Zero(t, n, "a failed batch outside a transaction writes nothing")
}

func wireExpectStopsTheBatchOnTheServer(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	err := p.Batch(ctx,
		storage.S(`INSERT INTO w (id) VALUES (1)`),
		storage.Statement{SQL: `UPDATE w SET s = 'x' WHERE id = $1`, Args: []any{404}, Expect: 1, What: "the guarded update"},
		storage.S(`INSERT INTO w (id) VALUES (2)`))
	var ce *storage.ConflictError
	require.ErrorAs(t, err, &ce, "err: %v", err)
	require.ErrorIs(t, err, storage.ErrConflict)
	require.Equal(t, 1, ce.Index)
	require.EqualValues(t, 0, ce.Affected)
	require.Equal(t, "the guarded update", ce.What)
	var n int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w`), &n))
	require.Zero(t, n)

	n64, err := p.Exec(ctx, storage.Statement{SQL: `INSERT INTO w (id) VALUES ($1)`, Args: []any{5}, Expect: 1})
	require.NoError(t, err)
	require.EqualValues(t, 1, n64)
}

func wireBeginCarriesFirstStatements(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	tx, err := p.Begin(ctx, storage.TxOptions{First: []storage.Statement{storage.S(`INSERT INTO w (id, s) VALUES ($1, $2)`, 7, "first")}})
	require.NoError(t, err)
	var s string
	require.NoError(t, tx.QueryRow(ctx, storage.S(`SELECT s FROM w WHERE id = 7`), &s))
	require.Equal(t, "first", s)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, tx.Rollback(ctx), "a second Rollback is a no-op")

	// An unmet Expect of a first statement is Begin's error, and no
	// transaction stays open on the connection.
	_, err = p.Begin(ctx, storage.TxOptions{First: []storage.Statement{{SQL: `UPDATE w SET s = 'y' WHERE id = 404`, Expect: 1, What: "the mark"}}})
	var ce *storage.ConflictError
	require.ErrorAs(t, err, &ce, "err: %v", err)
	for range 3 { // every pooled connection is usable
		var n int
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w`), &n))
	}
}

func wireTxCommitsAndHandsItsHandle(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	q, err := storage.From(tx.Handle())
	require.NoError(t, err)
	require.Equal(t, p.Driver(), q.Driver())
	_, err = q.Exec(ctx, storage.S(`INSERT INTO w (id) VALUES (8)`))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	var n int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w WHERE id = 8`), &n))
	require.Equal(t, 1, n)
}

func wireQueueSendsAtFlush(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	q := storage.NewQueue(p)
	_, err := q.Exec(ctx, storage.S(`INSERT INTO w (id) VALUES ($1)`, 20))
	require.NoError(t, err)
	require.ErrorIs(t, q.QueryRow(ctx, storage.S(`SELECT 1`)), storage.ErrQueued)
	var n int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w`), &n))
	require.Zero(t, n, "nothing is sent before Flush")
	require.NoError(t, q.Flush(ctx, storage.S(`INSERT INTO w (id) VALUES ($1)`, 21)))
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w`), &n))
	require.Equal(t, 2, n)
}

func wireCancelledContext(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err := p.Exec(cctx, storage.S(`SELECT 1`))
	require.Error(t, err)
	require.True(t, errors.Is(err, context.Canceled), "err: %v", err)
}
