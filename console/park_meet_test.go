package console_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/http"
	"net/url"
	"slices"
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
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// The operator's real path, counted from the consumer's table: an order
// event goes out through the outbox and the relay to a broker and a
// consumer behind park; its handler refuses it (a business rule), park
// dead-letters it and holds its key, and the key's next event is parked
// behind it. The operator edits the dead letter in the console and
// replays it (through the outbox and the relay again), then runs
// `millwright parked release` (park.Store.Release, what the CLI calls), as
// the runbook says. The consumer's table then holds the edited event once,
// before the key's next event: the fix is applied in its key's place, not
// taken for a redelivery of the parked copy and dropped.
//
// It runs on a gochannel broker that keeps a topic's order, and on every
// transport kind's broker (the real ones transporttest finds, else the
// embedded ones).
func TestConsoleEditReplayOfHeldKeyReachesTheConsumer(t *testing.T) {
	t.Parallel()
	t.Run("ordered-gochannel", func(t *testing.T) {
		t.Parallel()
		// Publish returns once the consumer acked (gochannel otherwise
		// hands each message to a goroutine of its own).
		broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		t.Cleanup(func() { _ = broker.Close() })
		testEditReplayOfHeldKey(t, "orders", broker, broker)
	})
	if testing.Short() {
		return
	}
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			var r [4]byte
			_, _ = rand.Read(r[:])
			suffix := hex.EncodeToString(r[:])
			topic, group := "console_park_orders_"+suffix, "console_park_ledger_"+suffix
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, []string{topic}, group)
			}
			tr := transporttest.Open(t, kind)
			sub, err := tr.Subscriber(group)
			require.NoError(t, err)
			if init, ok := sub.(message.SubscribeInitializer); ok {
				require.NoError(t, init.SubscribeInitialize(topic))
			}
			testEditReplayOfHeldKey(t, topic, tr.Publisher(), sub)
		})
	}
}

func testEditReplayOfHeldKey(t *testing.T, topic string, pub message.Publisher, sub message.Subscriber) {
	b := setup(t)
	db := b.schema.DB
	ctx := context.Background()
	_, err := db.Exec(`CREATE TABLE ledger (seq BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL, payload TEXT NOT NULL)`)
	require.NoError(t, err)

	rel, err := relay.New(postgres.From(db), pub, relay.Config{PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- rel.Run(ctx) }()
	t.Cleanup(func() { _ = rel.Close(); <-relayDone })

	parker, err := park.New(postgres.From(db), park.Config{PollInterval: 10 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 5 * time.Millisecond, MaxInterval: 5 * time.Millisecond, Jitter: retry.JitterNone, MaxAttempts: 50}})
	require.NoError(t, err)
	rm, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 2, Jitter: retry.JitterNone}})
	require.NoError(t, err)
	var refused, replays atomic.Int64
	apply := func(m *message.Message) error {
		if string(m.Payload) == "bad" {
			refused.Add(1)
			return failure.Permanent(errors.New("order refused: amount missing"))
		}
		_, err := db.ExecContext(m.Context(), `INSERT INTO ledger (event_id, payload) VALUES ($1, $2)`, m.Metadata.Get(metadata.EventID), string(m.Payload))
		return err
	}
	countReplays := func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err == nil && m.Metadata.Get(metadata.DeadLetterReplayOf) != "" {
				replays.Add(1) // acked
			}
			return out, err
		}
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("ledger", topic, sub, apply).
		AddMiddleware(countReplays, parker.Middleware("ledger"), rm.Middleware)
	rctx, stopRouter := context.WithCancel(ctx)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	t.Cleanup(func() { stopRouter(); <-routerDone })
	select {
	case <-router.Running():
	case <-time.After(60 * time.Second):
		t.Fatal("router did not start")
	}
	pctx, stopParker := context.WithCancel(ctx)
	parkerDone := make(chan error, 1)
	go func() { parkerDone <- parker.Run(pctx) }()
	t.Cleanup(func() { stopParker(); <-parkerDone })

	ledger := func() []string {
		rows, err := db.Query(`SELECT event_id || '=' || payload FROM ledger ORDER BY seq`)
		require.NoError(t, err)
		defer rows.Close()
		var out []string
		for rows.Next() {
			var s string
			require.NoError(t, rows.Scan(&s))
			out = append(out, s)
		}
		require.NoError(t, rows.Err())
		return out
	}
	event := func(id, payload string) outbox.Event {
		return outbox.Event{Topic: topic, ID: id, Payload: []byte(payload), RawPayload: true, AggregateType: "order", AggregateID: "42", EventType: "order.placed"}
	}
	keys := park.NewStore(postgres.From(db))
	parked := func(n int64) func() bool {
		return func() bool {
			ks, err := keys.List(ctx, park.Filter{})
			require.NoError(t, err)
			return len(ks) == 1 && ks[0].Held && ks[0].Messages == n
		}
	}
	// One event at a time: a broker may deliver two published back to
	// back in either order (gochannel does); the order tested is park's.
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(db), event("e1", "bad")))
	poll.Until(t, 90*time.Second, parked(1), "e1 dead-lettered, its key held")
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(db), event("e2", "two")))
	poll.Until(t, 90*time.Second, parked(2), "e2 parked behind e1")
	require.EqualValues(t, 1, refused.Load())
	require.Empty(t, ledger())
	dls, err := b.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, "e1", dls[0].MessageUUID)

	// The console: edit the payload, replay.
	status, body := b.post(t, "/dead-letters/"+strconv.FormatInt(dls[0].ID, 10)+"/edit", b.token(t),
		url.Values{"encoding": {"text"}, "payload": {"one-fixed"}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	poll.Until(t, 90*time.Second, func() bool { return replays.Load() == 1 }, "the edited copy consumed and acked")

	// The runbook's next step; the replay already released the hold.
	if err := keys.Release(ctx, "ledger", "order/42", false); err != nil {
		require.ErrorIs(t, err, park.ErrNotParked)
	}
	has := func(row string) func() bool {
		return func() bool { return slices.Contains(ledger(), row) }
	}
	poll.Until(t, 90*time.Second, has("e2=two"), "the key's next event applied")
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(db), event("e3", "three")))
	poll.Until(t, 90*time.Second, has("e3=three"), "a later event goes straight through")
	require.Equal(t, []string{"e1=one-fixed", "e2=two", "e3=three"}, ledger(),
		"the edited event applied once, in its key's place, before the key's later events")
	ks, err := keys.List(ctx, park.Filter{})
	require.NoError(t, err)
	require.Empty(t, ks, "nothing left parked")
	d, err := b.store.Get(ctx, dls[0].ID)
	require.NoError(t, err)
	require.Equal(t, dlq.StateSuperseded, d.State, "the dead letter was replaced by its edited copy")
}
