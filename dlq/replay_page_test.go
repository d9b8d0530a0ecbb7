package dlq

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// TestReplayPagesThroughTheBacklog replays more rows than one page holds,
// with and without a limit that ends mid-page, in id order, each once.
func TestReplayPagesThroughTheBacklog(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	store := &Store{pool: storage.NewSQLPool(s.DB)}
	by := audit.Operator{User: "tester"}
	ctx := context.Background()
	var ids []int64
	for i := range 10 {
		msg := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
		msg.Metadata.Set(metadata.DeadLetterTopic, "orders.dlq")
		id, err := store.Insert(ctx, msg)
		require.NoError(t, err)
		ids = append(ids, id)
	}
	dry, err := replay(ctx, store.pool, ReplayOptions{DryRun: true, page: 3})
	require.NoError(t, err)
	require.Len(t, dry.Items, 10, "a dry run pages through everything")

	rep, err := replay(ctx, store.pool, ReplayOptions{Filter: Filter{Limit: 7}, page: 3, By: by})
	require.NoError(t, err)
	require.Len(t, rep.Items, 7)
	for i, it := range rep.Items {
		require.Equal(t, ids[i], it.ID, "id order across pages")
	}
	rep, err = replay(ctx, store.pool, ReplayOptions{page: 3, By: by})
	require.NoError(t, err)
	require.Len(t, rep.Items, 3)
	require.Equal(t, ids[7], rep.Items[0].ID)
	require.Equal(t, 7, rep.SkippedReplayed)

	rep, err = replay(ctx, store.pool, ReplayOptions{Force: true, Filter: Filter{IDs: []int64{ids[1], ids[4], ids[8], ids[9]}}, page: 3, By: by})
	require.NoError(t, err)
	require.Len(t, rep.Items, 4)
	pending, err := store.Count(ctx, Filter{Pending: true})
	require.NoError(t, err)
	require.Zero(t, pending)
	queued := pgtest.Column[string](t, s.DB, `SELECT payload_raw::text FROM millwright_outbox ORDER BY id`)
	require.Len(t, queued, 14, "10 replays, then 4 forced, each queued once")
}
