package storagetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("idempotency", exerciseIdempotency) }

// markWait bounds every wait of these contracts for a mark that should end.
const markWait = 30 * time.Second

func markProcessed(t *testing.T, p storage.Pool, consumer, id string) bool {
	t.Helper()
	ok, err := storage.IsProcessed(context.Background(), p, consumer, id)
	require.NoError(t, err)
	return ok
}

// exerciseIdempotency checks the processed marks' operations.
func exerciseIdempotency(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(*testing.T, Setup)
	}{
		{"BeginMarkThenDuplicate", marksBeginMarkThenDuplicate},
		{"MarkInATransactionKeepsItUsable", marksMarkInATransactionKeepsItUsable},
		{"MarkAloneCommits", marksMarkAloneCommits},
		{"ConcurrentMarkWaitsForTheHolder", marksConcurrentMarkWaitsForTheHolder},
		{"LockTimeoutIs55P03", marksLockTimeoutIs55P03},
		{"MissingTableIs42P01", marksMissingTableIs42P01},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t))
		})
	}
}

func marksBeginMarkThenDuplicate(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	tx, fresh, err := storage.BeginMarkProcessed(ctx, p, "c", "e1", time.Second)
	require.NoError(t, err)
	require.True(t, fresh)
	require.False(t, markProcessed(t, p, "c", "e1"), "an uncommitted mark is invisible")
	require.NoError(t, tx.Commit(ctx))
	require.True(t, markProcessed(t, p, "c", "e1"))
	require.False(t, markProcessed(t, p, "other", "e1"), "marks are per consumer")

	tx, fresh, err = storage.BeginMarkProcessed(ctx, p, "c", "e1", time.Second)
	require.NoError(t, err)
	require.False(t, fresh, "a committed mark makes a duplicate")
	require.Nil(t, tx, "a duplicate leaves no transaction")
	for range 3 { // and no pooled connection inside one
		require.False(t, markProcessed(t, p, "c", "nope"))
	}
}

func marksMarkInATransactionKeepsItUsable(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	tx, err := storage.BeginProcessedMarks(ctx, p, -1)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	fresh, err := storage.MarkProcessed(ctx, tx, "c", "e1")
	require.NoError(t, err)
	require.True(t, fresh)
	fresh, err = storage.MarkProcessed(ctx, tx, "c", "e1")
	require.NoError(t, err)
	require.False(t, fresh, "the same transaction's mark is a duplicate")
	fresh, err = storage.MarkProcessed(ctx, tx, "c", "e2")
	require.NoError(t, err, "a duplicate does not abort the transaction")
	require.True(t, fresh)
	require.NoError(t, tx.Commit(ctx))
	require.True(t, markProcessed(t, p, "c", "e2"))
}

func marksMarkAloneCommits(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	fresh, err := storage.MarkProcessedAlone(ctx, p, "c", "e1", time.Second)
	require.NoError(t, err)
	require.True(t, fresh)
	require.True(t, markProcessed(t, p, "c", "e1"))
	fresh, err = storage.MarkProcessedAlone(ctx, p, "c", "e1", -1)
	require.NoError(t, err)
	require.False(t, fresh)
}

func marksConcurrentMarkWaitsForTheHolder(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	for _, commit := range []bool{true, false} {
		// Unique in the server: the waiter is found by its statement.
		id := fmt.Sprintf("held-%t-%d", commit, time.Now().UnixNano())
		holder, fresh, err := storage.BeginMarkProcessed(ctx, p, "c", id, -1)
		require.NoError(t, err)
		require.True(t, fresh)
		type result struct {
			fresh bool
			err   error
		}
		done := make(chan result, 1)
		go func() {
			tx, fresh, err := storage.BeginMarkProcessed(ctx, p, "c", id, markWait)
			if tx != nil {
				_ = tx.Rollback(ctx)
			}
			done <- result{fresh, err}
		}()
		waitingOn(t, st, id)
		if commit {
			require.NoError(t, holder.Commit(ctx))
		} else {
			require.NoError(t, holder.Rollback(ctx))
		}
		select {
		case r := <-done:
			require.NoError(t, r.err)
			require.Equal(t, !commit, r.fresh, "after the holder's commit=%t", commit)
		case <-time.After(markWait):
			t.Fatal("the waiting BeginMark did not return")
		}
	}
}

func marksLockTimeoutIs55P03(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	holder, _, err := storage.BeginMarkProcessed(ctx, p, "c", "held", -1)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	const timeout = 200 * time.Millisecond

	start := time.Now()
	_, err = storage.MarkProcessedAlone(ctx, p, "c", "held", timeout)
	require.Equal(t, "55P03", storage.Code(err), "MarkProcessedAlone: %v", err)
	require.GreaterOrEqual(t, time.Since(start), timeout)

	_, _, err = storage.BeginMarkProcessed(ctx, p, "c", "held", timeout)
	require.Equal(t, "55P03", storage.Code(err), "BeginMarkProcessed: %v", err)

	tx, err := storage.BeginProcessedMarks(ctx, p, timeout)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = storage.MarkProcessed(ctx, tx, "c", "held")
	require.Equal(t, "55P03", storage.Code(err), "MarkProcessed in BeginProcessedMarks' transaction: %v", err)
}

func marksMissingTableIs42P01(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	_, err := p.Exec(ctx, storage.S(`DROP TABLE millwright_processed_events`))
	require.NoError(t, err)
	_, err = storage.IsProcessed(ctx, p, "c", "e")
	require.Equal(t, "42P01", storage.Code(err), "%v", err)
	_, _, err = storage.BeginMarkProcessed(ctx, p, "c", "e", -1)
	require.Equal(t, "42P01", storage.Code(err), "%v", err)
}

// waitingOn waits until a statement mentioning text waits on a lock.
func waitingOn(t *testing.T, st Setup, text string) {
	t.Helper()
	poll.Until(t, markWait, func() bool {
		var n int
		require.NoError(t, st.Schema.DB.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0`, text).Scan(&n))
		return n > 0
	}, "a statement mentioning %q to wait on a lock", text)
}
