package outbox

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestOps_StatsAndRetryFailed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	require.NoError(t, Add(ctx, b.db,
		Event{Topic: "a", AggregateID: "1"}, Event{Topic: "a", AggregateID: "2"},
		Event{Topic: "b", AggregateID: "3"}, Event{Topic: "b", AggregateID: "4"}))
	_, err := b.db.Exec(`UPDATE millwright_outbox SET status = 'failed', retry_count = 20, last_error = 'boom' WHERE aggregate_id IN ('2', '3', '4')`)
	require.NoError(t, err)

	st, err := ReadStats(ctx, b.db)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Pending)
	require.EqualValues(t, 3, st.Failed)
	ts, err := ReadTopicStats(ctx, b.db)
	require.NoError(t, err)
	require.Len(t, ts, 2)
	require.Equal(t, TopicStats{Topic: "a", Pending: 1, OldestPendingAge: ts[0].OldestPendingAge, Failed: 1}, ts[0])
	require.Equal(t, TopicStats{Topic: "b", Failed: 2}, ts[1])

	dry, err := RetryFailed(ctx, b.db, FailedFilter{Topic: "b"}, true)
	require.NoError(t, err)
	require.Len(t, dry, 2)
	require.Equal(t, "boom", dry[0].LastError)
	require.Equal(t, 3, count(t, b.db, "status = 'failed'"), "dry run changes nothing")

	done, err := RetryFailed(ctx, b.db, FailedFilter{IDs: []int64{dry[0].ID}}, false)
	require.NoError(t, err)
	require.Len(t, done, 1)
	require.Equal(t, 2, count(t, b.db, "status = 'failed'"))
	require.Equal(t, 1, count(t, b.db, "status = 'pending' AND retry_count = 0 AND aggregate_id = '3'"))
}
