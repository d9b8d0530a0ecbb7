package dlq

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
)

// TestReplayPagesThroughTheBacklog replays more rows than one page holds,
// with and without a limit that ends mid-page, in id order, each once.
func TestReplayPagesThroughTheBacklog(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, Migrations())
	s.DB.SetMaxOpenConns(2)
	store := &Store{pool: storage.NewSQLPool(s.DB), replayPage: 3}
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
	pub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pub.Close()

	dry, err := store.Replay(ctx, nil, ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Items, 10, "a dry run pages through everything")

	rep, err := store.Replay(ctx, pub, ReplayOptions{Filter: Filter{Limit: 7}})
	require.NoError(t, err)
	require.Len(t, rep.Items, 7)
	for i, it := range rep.Items {
		require.Equal(t, ids[i], it.ID, "id order across pages")
	}
	rep, err = store.Replay(ctx, pub, ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Items, 3)
	require.Equal(t, ids[7], rep.Items[0].ID)
	require.Equal(t, 7, rep.SkippedReplayed)

	rep, err = store.Replay(ctx, pub, ReplayOptions{Force: true, Filter: Filter{IDs: []int64{ids[1], ids[4], ids[8], ids[9]}}})
	require.NoError(t, err)
	require.Len(t, rep.Items, 4)
	pending, err := store.Count(ctx, Filter{Pending: true})
	require.NoError(t, err)
	require.Zero(t, pending)
}
