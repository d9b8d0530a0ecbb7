package outbox

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// retryFailedOn is RetryFailed on a pool of either driver.
func retryFailedOn(ctx context.Context, t *testing.T, h any, f FailedFilter, dryRun bool) ([]FailedEvent, error) {
	switch db := h.(type) {
	case *sql.DB:
		return RetryFailed(ctx, postgres.From(db), f, dryRun)
	case *pgxpool.Pool:
		return RetryFailed(ctx, postgres.From(db), f, dryRun)
	}
	t.Fatalf("no RetryFailed on a %T", h)
	return nil, nil
}

func TestOps_StatsAndRetryFailed(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		ctx := context.Background()
		require.NoError(t, AddOutsideTx(ctx, b.pdb,
			Event{Topic: "a", AggregateID: "1"}, Event{Topic: "a", AggregateID: "2"},
			Event{Topic: "b", AggregateID: "3"}, Event{Topic: "b", AggregateID: "4"}))
		_, err := b.db.Exec(`UPDATE millwright_outbox SET status = 'failed', retry_count = 20, last_error = 'boom' WHERE aggregate_id IN ('2', '3', '4')`)
		require.NoError(t, err)

		st, err := ReadStats(ctx, b.pdb)
		require.NoError(t, err)
		require.EqualValues(t, 1, st.Pending)
		require.EqualValues(t, 3, st.Failed)
		ts, err := ReadTopicStats(ctx, b.pdb)
		require.NoError(t, err)
		require.Len(t, ts, 2)
		require.Equal(t, TopicStats{Topic: "a", Pending: 1, OldestPendingAge: ts[0].OldestPendingAge, Failed: 1}, ts[0])
		require.Equal(t, TopicStats{Topic: "b", Failed: 2}, ts[1])
		ps, err := ReadProblems(ctx, b.pdb, 10)
		require.NoError(t, err)
		require.Len(t, ps, 3)

		dry, err := retryFailedOn(ctx, t, b.handle, FailedFilter{Topic: "b"}, true)
		require.NoError(t, err)
		require.Len(t, dry, 2)
		require.Equal(t, "boom", dry[0].LastError)
		require.Equal(t, 3, count(t, b.db, "status = 'failed'"), "dry run changes nothing")

		done, err := retryFailedOn(ctx, t, b.handle, FailedFilter{IDs: []int64{dry[0].ID}}, false)
		require.NoError(t, err)
		require.Len(t, done, 1)
		require.Equal(t, 2, count(t, b.db, "status = 'failed'"))
		require.Equal(t, 1, count(t, b.db, "status = 'pending' AND retry_count = 0 AND aggregate_id = '3'"))
	})
}
