package saga

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// A transition costs the statements it did before the storage layer: the
// row lock, then one batch (the command's outbox rows, the instance row and
// the history); plus one read of the history only when the decision needs
// it. A round of deadlines is one claim, the history reads its decisions
// need, and one batch for all of them. Counted on each driver (BEGIN and
// COMMIT aside).
func TestRoundTripsPerTransition(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), Migrations())
		type data struct{}
		cmd := func(data) (Command, error) { return Command{Topic: "t"}, nil }
		def, err := Define("rt",
			Step[data]{Name: "one", Command: cmd, Compensation: cmd, Timeout: time.Hour},
			Step[data]{Name: "two", Command: cmd, Compensation: cmd, Timeout: time.Hour})
		require.NoError(t, err)
		o, err := NewOrchestrator(postgres.From(s.DB), def, Config{})
		require.NoError(t, err)
		pool := s.Pool(t, driver)
		counting := &countingPool{Pool: pool}
		o.pool = counting
		ctx := context.Background()
		for _, id := range []string{"a", "b", "c"} {
			require.NoError(t, o.Start(ctx, storage.AsTx(pool), id, data{}))
		}

		handle := func(id, step, phase string, attempt int, typ string) int64 {
			t.Helper()
			msg := message.NewMessage("r-"+id+step+typ, []byte(`{}`))
			for k, v := range map[string]string{metadata.SagaID: id, metadata.SagaType: "rt", metadata.SagaStep: step,
				metadata.SagaPhase: phase, metadata.SagaAttempt: strconv.Itoa(attempt), metadata.SagaReplyType: typ} {
				msg.Metadata.Set(k, v)
			}
			before := counting.n.Load()
			require.NoError(t, o.HandleReply(msg))
			return counting.n.Load() - before
		}
		require.EqualValues(t, 2, handle("a", "one", PhaseForward, 1, "one.succeeded"), "success: lock, write")
		require.EqualValues(t, 3, handle("a", "two", PhaseForward, 1, "two.failed"), "failure: lock, history, write")
		require.EqualValues(t, 3, handle("a", "two", PhaseForward, 1, "two.failed"), "duplicate: lock, history, write")
		info, _, err := Get(ctx, storage.AsTx(pool), "a")
		require.NoError(t, err)
		require.Equal(t, StateCompensating, info.State)

		// b and c time out: one claim, one history read each (their
		// compensation starts), one write.
		_, err = pool.Exec(ctx, storage.S(`UPDATE millwright_saga_instances SET deadline_at = now() - interval '1 second' WHERE id IN ('b', 'c')`))
		require.NoError(t, err)
		before := counting.n.Load()
		n, err := o.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.EqualValues(t, 4, counting.n.Load()-before)
		for _, id := range []string{"b", "c"} {
			info, _, err := Get(ctx, storage.AsTx(pool), id)
			require.NoError(t, err)
			require.Equal(t, StateCompensating, info.State, id)
		}
	})
}

// countingPool counts the statements (a batch is one) its transactions
// run.
type countingPool struct {
	storage.Pool
	n atomic.Int64
}

func (p *countingPool) Begin(ctx context.Context, opts storage.TxOptions) (storage.Tx, error) {
	tx, err := p.Pool.Begin(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, n: &p.n}, nil
}

type countingTx struct {
	storage.Tx
	n *atomic.Int64
}

func (t *countingTx) Exec(ctx context.Context, s storage.Statement) (int64, error) {
	t.n.Add(1)
	return t.Tx.Exec(ctx, s)
}

func (t *countingTx) Query(ctx context.Context, s storage.Statement, scan func(storage.Row) error) error {
	t.n.Add(1)
	return t.Tx.Query(ctx, s, scan)
}

func (t *countingTx) QueryRow(ctx context.Context, s storage.Statement, dest ...any) error {
	t.n.Add(1)
	return t.Tx.QueryRow(ctx, s, dest...)
}

func (t *countingTx) Batch(ctx context.Context, ss ...storage.Statement) error {
	if len(ss) > 0 {
		t.n.Add(1)
	}
	return t.Tx.Batch(ctx, ss...)
}
