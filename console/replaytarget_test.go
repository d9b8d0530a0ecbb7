package console_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// The operator's path through the console (replay, then the outbox and
// the relay to the broker), counted from each consumer group's table.
// Three groups consume "orders": "ledger" (dlq.Middleware, idempotent)
// and "audit" (park, no idempotency) applied order 42; "billing" (park)
// refused it, so park dead-lettered it and held its key. ledger's
// processed mark is then deleted, as idempotency's cleaner does after 7
// days while dead letters are kept 90. The console's replay reaches all
// three groups: billing applies it once, in its key's place; ledger and
// audit ack it without running their handler.
func TestConsoleReplayIsAppliedOnlyByTheConsumerThatDeadLetteredIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.schema.DB
	ctx := context.Background()
	for _, g := range []string{"ledger", "audit", "billing"} {
		_, err := db.Exec(fmt.Sprintf(`CREATE TABLE effects_%s (event_id TEXT NOT NULL)`, g))
		require.NoError(t, err)
	}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	rel, err := relay.New(postgres.From(db), ps, relay.Config{PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- rel.Run(ctx) }()
	t.Cleanup(func() { _ = rel.Close(); <-relayDone })
	idem, err := idempotency.NewPostgresStore(postgres.From(db))
	require.NoError(t, err)

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var billingRefuses atomic.Bool
	billingRefuses.Store(true)
	var refused atomic.Int64
	replays := map[string]*atomic.Int64{}
	var parkers []*park.Parker
	var ledgerDLQ *dlq.Middleware
	for _, name := range []string{"ledger", "audit", "billing"} {
		replays[name] = &atomic.Int64{}
		apply := func(m *message.Message) error {
			if name == "billing" && billingRefuses.Load() {
				refused.Add(1)
				return failure.Permanent(errors.New("billing: customer 7 unknown"))
			}
			q := `INSERT INTO effects_` + name + ` (event_id) VALUES ($1)`
			if tx, ok := idempotency.TxFromContext(m.Context()); ok {
				_, err := tx.SQL().ExecContext(m.Context(), q, m.Metadata.Get(metadata.EventID))
				return err
			}
			_, err := db.ExecContext(m.Context(), q, m.Metadata.Get(metadata.EventID))
			return err
		}
		countReplays := func(h message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) {
				out, err := h(m)
				if err == nil && m.Metadata.Get(metadata.DeadLetterReplayOf) != "" {
					replays[name].Add(1) // acked
				}
				return out, err
			}
		}
		mws := []message.HandlerMiddleware{countReplays}
		if name == "ledger" {
			ledgerDLQ, err = dlq.NewMiddleware(ps, dlq.Config{ConsumerGroup: name, Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 2}})
			require.NoError(t, err)
			dedup, err := idempotency.NewMiddleware(idem, idempotency.Config{Consumer: name})
			require.NoError(t, err)
			mws = append(mws, ledgerDLQ.Middleware, dedup.Middleware)
		} else {
			p, err := park.New(postgres.From(db), park.Config{ConsumerGroup: name, PollInterval: 10 * time.Millisecond,
				Retry: retry.Policy{InitialInterval: 5 * time.Millisecond, MaxInterval: 5 * time.Millisecond, Jitter: retry.JitterNone, MaxAttempts: 50}})
			require.NoError(t, err)
			parkers = append(parkers, p)
			mws = append(mws, p.Middleware(name))
		}
		router.AddConsumerHandler(name, "orders", ps, apply).AddMiddleware(mws...)
	}
	rctx, stopRouter := context.WithCancel(ctx)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	t.Cleanup(func() { stopRouter(); <-routerDone })
	select {
	case <-router.Running():
	case <-time.After(60 * time.Second):
		t.Fatal("router did not start")
	}
	for _, p := range parkers {
		pctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- p.Run(pctx) }()
		t.Cleanup(func() { stop(); <-done })
	}

	effects := func(g string) int {
		return pgtest.Column[int](t, db, `SELECT count(*)::int FROM effects_`+g+` WHERE event_id = 'order-42'`)[0]
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(db), outbox.Event{Topic: "orders", ID: "order-42", Payload: []byte(`{"order":42}`), RawPayload: true,
		AggregateType: "order", AggregateID: "42", EventType: "order.placed"}))
	var dls []dlq.DeadLetter
	poll.Until(t, 90*time.Second, func() bool {
		dls, err = b.store.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		return len(dls) == 1 && effects("ledger") == 1 && effects("audit") == 1
	}, "ledger and audit applied order 42, billing dead-lettered it")
	require.Equal(t, "billing", dls[0].ConsumerGroup)
	require.Equal(t, "billing", dls[0].Handler)
	require.EqualValues(t, 1, refused.Load())
	require.Zero(t, effects("billing"))

	res, err := db.Exec(`DELETE FROM millwright_processed_events WHERE consumer = 'ledger'`)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "ledger's mark existed and is gone")
	billingRefuses.Store(false)

	status, body := b.post(t, "/dead-letters/replay", b.token(t), url.Values{"id": {strconv.FormatInt(dls[0].ID, 10)}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	poll.Until(t, 90*time.Second, func() bool {
		return replays["ledger"].Load() == 1 && replays["audit"].Load() == 1 && replays["billing"].Load() == 1 && effects("billing") == 1
	}, "every group acked the replay and billing applied it")
	require.Equal(t, 1, effects("billing"), "the group that dead-lettered it applies the replay once")
	require.Equal(t, 1, effects("ledger"), "a group that applied the original does not apply the replay, mark or no mark")
	require.Equal(t, 1, effects("audit"), "a group without idempotency does not apply the replay")
	require.EqualValues(t, 1, ledgerDLQ.Stats().ReplaysSkipped)
}

// The replay's dry run names the consumer each replay is for, and warns
// before one that every consumer group on the topic would run.
func TestConsoleReplayDryRunSaysWhichConsumerAReplayIsFor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	targeted := b.deadLetter(t, "sel", "T", "boom", []byte(`{"n":1}`),
		map[string]string{metadata.DeadLetterConsumerGroup: "billing", metadata.DeadLetterHandler: "charge"})
	old := b.deadLetter(t, "sel", "T", "boom", []byte(`{"n":2}`), nil)
	form := url.Values{"id": {strconv.FormatInt(targeted, 10)}, "action": {"preview"}}
	status, body := b.post(t, "/dead-letters/replay", b.token(t), form)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "dlq_replay_for: billing/charge")
	require.Contains(t, body, "For consumer <b>billing/charge</b> only")
	require.NotContains(t, body, "records no consumer")

	form.Set("id", strconv.FormatInt(old, 10))
	status, body = b.post(t, "/dead-letters/replay", b.token(t), form)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "this dead letter records no consumer, so every consumer group on sel receives the replay and runs it")
	require.NotContains(t, body, "dlq_replay_for")
}
