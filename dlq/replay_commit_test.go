package dlq

import (
	"context"
	"errors"
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

// lostAnswerPool's transactions lose their commit's answer: Commit
// returns an error, after committing (applied) or without sending it.
type lostAnswerPool struct {
	storage.Pool
	applied bool
}

func (p lostAnswerPool) Begin(ctx context.Context, opts storage.TxOptions) (storage.Tx, error) {
	tx, err := p.Pool.Begin(ctx, opts)
	return lostAnswerTx{Tx: tx, applied: p.applied}, err
}

type lostAnswerTx struct {
	storage.Tx
	applied bool
}

var errAnswerLost = errors.New("the commit's answer was lost")

func (t lostAnswerTx) Commit(ctx context.Context) error {
	if t.applied {
		if err := t.Tx.Commit(ctx); err != nil {
			return err
		}
	}
	return errAnswerLost
}

// A replay whose commit's answer is lost reads the outcome back: a
// commit the server applied counts the row as replayed (what the table
// holds); one never applied is the error, and the row stays pending
// (nothing queued), without waiting on its own lock.
func TestReplayReadsBackACommitWhoseAnswerWasLost(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, Migrations(), outbox.Migrations(), audit.Migrations())
	ctx := context.Background()
	for _, applied := range []bool{true, false} {
		store := &Store{pool: lostAnswerPool{Pool: storage.NewSQLPool(s.DB), applied: applied}}
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
		id, err := store.Insert(ctx, msg)
		require.NoError(t, err)

		rep, err := replay(ctx, store.pool, ReplayOptions{Filter: Filter{IDs: []int64{id}}, By: audit.Operator{User: "tester"}})
		d, gerr := store.Get(ctx, id)
		require.NoError(t, gerr)
		if applied {
			require.NoError(t, err)
			require.Len(t, rep.Items, 1, "the applied commit counts")
			require.NotNil(t, d.ReplayedAt)
			continue
		}
		require.ErrorIs(t, err, errAnswerLost)
		require.ErrorContains(t, err, "committing the replay of dead letter")
		require.Empty(t, rep.Items)
		require.Nil(t, d.ReplayedAt, "never applied: still pending")
	}
}
