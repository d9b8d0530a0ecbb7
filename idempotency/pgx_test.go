package idempotency_test

import (
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
)

// On a *pgxpool.Pool the handler gets a pgx.Tx, and its effect, the mark
// and the produced outbox event commit together: a commit that fails (a
// deferred constraint the effect breaks) leaves none of the three, a
// failing handler leaves none, the next delivery commits all three, and a
// redelivery after that is skipped.
func TestPgxTransactionCarriesEffectMarkAndOutbox(t *testing.T) {
	t.Parallel()
	b := setupPGOn(t, pgtest.DriverPgx, outbox.Migrations())
	db := b.schema.DB
	_, err := db.Exec(`CREATE TABLE keys (k TEXT, UNIQUE (k) DEFERRABLE INITIALLY DEFERRED); INSERT INTO keys VALUES ('taken')`)
	require.NoError(t, err)
	m, reg := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing", ProducedToOutbox: true, ProducedTopic: "invoices"})

	var runs atomic.Int32
	key, fail := "taken", false
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		pt0, _ := idempotency.TxFromContext(msg.Context())
		onSQL := pt0.SQL() != nil
		require.False(t, onSQL, "no *sql.Tx on a pgx store")
		pt, ok := idempotency.TxFromContext(msg.Context())
		tx := pt.Pgx()
		require.True(t, ok, "the handler gets the pgx.Tx")
		ctx := msg.Context()
		if _, err := tx.Exec(ctx, `INSERT INTO effects (consumer, event_id) VALUES ($1, $2)`, "billing", "evt-1"); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO keys VALUES ($1)`, key); err != nil {
			return nil, err
		}
		if fail {
			return nil, testError("boom")
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{"invoice":1}`))}, nil
	})
	counts := func() (effects, marks, events int) {
		return countRows(t, db, `SELECT count(*) FROM effects`),
			countRows(t, db, `SELECT count(*) FROM millwright_processed_events`),
			countRows(t, db, `SELECT count(*) FROM millwright_outbox WHERE topic = 'invoices'`)
	}

	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.Error(t, err, "the commit breaks the deferred constraint")
	e, mk, ev := counts()
	require.Equal(t, [3]int{0, 0, 0}, [3]int{e, mk, ev}, "a failed commit leaves no effect, mark or outbox event")

	key, fail = "free", true
	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.ErrorContains(t, err, "boom")
	e, mk, ev = counts()
	require.Equal(t, [3]int{0, 0, 0}, [3]int{e, mk, ev}, "a failing handler leaves no effect, mark or outbox event")

	fail = false
	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err)
	e, mk, ev = counts()
	require.Equal(t, [3]int{1, 1, 1}, [3]int{e, mk, ev}, "effect, mark and outbox event commit together")

	_, err = h(idempotencytest.NewMessage("evt-1", nil))
	require.NoError(t, err, "a redelivery")
	require.EqualValues(t, 3, runs.Load(), "the redelivery is skipped")
	e, mk, ev = counts()
	require.Equal(t, [3]int{1, 1, 1}, [3]int{e, mk, ev})
	require.EqualValues(t, 1, metric(t, reg, idempotency.MetricDuplicates, "billing"))
}
