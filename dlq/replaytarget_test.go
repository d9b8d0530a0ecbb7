package dlq_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// An operator replays a dead letter of one consumer group long after the
// fact: every consumer group on the topic receives the replay (it goes
// to the original topic), but only the group that gave up applies it.
// Three groups consume "orders", each into its own effects table:
//   - "ledger" (idempotent) applied order 42; its processed mark is then
//     deleted, as idempotency's cleaner does after 7 days while the dead
//     letter is kept 90;
//   - "audit" (no idempotency) applied it too;
//   - "billing" refused it (permanently), so it was dead-lettered.
//
// After `millwright dlq replay` (dlq.Replay), billing has applied it
// once and the other two still once each: they acked the replay without
// running their handler, and counted it.
//
// It runs on gochannel (each subscription a group) and, without -short,
// on every transport kind's broker with one consumer group per group.
func TestReplayIsAppliedOnlyByTheConsumerThatDeadLetteredIt(t *testing.T) {
	t.Parallel()
	t.Run("shared-gochannel", func(t *testing.T) {
		t.Parallel()
		ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
		t.Cleanup(func() { _ = ps.Close() })
		testReplayTargeted(t, "orders", ps, func(string) message.Subscriber { return ps })
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
			topic := "replay_target_" + suffix
			groups := []string{"ledger", "audit", "billing", "recorder"}
			for i, g := range groups {
				groups[i] = g + "_" + suffix
			}
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, []string{topic, dlq.DefaultTopic(topic)}, groups...)
			}
			tr := transporttest.Open(t, kind)
			subs := map[string]message.Subscriber{}
			for _, g := range groups {
				sub, err := tr.Subscriber(g)
				require.NoError(t, err)
				subTopic := topic
				if strings.HasPrefix(g, "recorder") {
					subTopic = dlq.DefaultTopic(topic)
				}
				if init, ok := sub.(message.SubscribeInitializer); ok {
					require.NoError(t, init.SubscribeInitialize(subTopic))
				}
				subs[strings.TrimSuffix(g, "_"+suffix)] = sub
			}
			testReplayTargeted(t, topic, tr.Publisher(), func(g string) message.Subscriber { return subs[g] })
		})
	}
}

// testReplayTargeted runs the scenario on topic: the groups "ledger",
// "audit" and "billing" (and "recorder" on the dead-letter topic) consume
// through subscriber(group), pub publishes.
func testReplayTargeted(t *testing.T, topic string, ps message.Publisher, subscriber func(group string) message.Subscriber) {
	ctx := context.Background()
	s := pgtest.New(t, dlq.Migrations(), idempotency.Migrations(), outbox.Migrations(), audit.Migrations())
	db := s.DB
	for _, g := range []string{"ledger", "audit", "billing"} {
		_, err := db.Exec(fmt.Sprintf(`CREATE TABLE effects_%s (event_id TEXT NOT NULL)`, g))
		require.NoError(t, err)
	}
	store := dlq.NewStore(postgres.From(db))
	stores.Store(store, storeOf{db: postgres.SQL(db), schema: s})
	idem, err := idempotency.NewPostgresStore(postgres.From(db))
	require.NoError(t, err)
	reg := prometheus.NewRegistry()

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	var billingRefuses atomic.Bool
	billingRefuses.Store(true)
	var refused atomic.Int64
	type group struct {
		mw      *dlq.Middleware
		replays atomic.Int64 // replays acked by the group, run or not
	}
	groups := map[string]*group{}
	for _, name := range []string{"ledger", "audit", "billing"} {
		g := &group{}
		groups[name] = g
		g.mw, err = dlq.NewMiddleware(ps, dlq.Config{Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 2},
			ConsumerGroup: name, Registerer: reg})
		require.NoError(t, err)
		apply := func(m *message.Message) ([]*message.Message, error) {
			if name == "billing" && billingRefuses.Load() {
				refused.Add(1)
				return nil, failure.Permanent(errors.New("billing: customer 7 unknown"))
			}
			q := `INSERT INTO effects_` + name + ` (event_id) VALUES ($1)`
			if pt, ok := idempotency.TxFromContext(m.Context()); ok && pt.SQL() != nil {
				tx := pt.SQL()
				_, err := tx.ExecContext(m.Context(), q, m.Metadata.Get(metadata.EventID))
				return nil, err
			}
			_, err := db.ExecContext(m.Context(), q, m.Metadata.Get(metadata.EventID))
			return nil, err
		}
		countReplays := func(h message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) {
				out, err := h(m)
				if err == nil && m.Metadata.Get(metadata.DeadLetterReplayOf) != "" {
					g.replays.Add(1)
				}
				return out, err
			}
		}
		mws := []message.HandlerMiddleware{countReplays, g.mw.Middleware}
		if name != "audit" {
			dedup, err := idempotency.NewMiddleware(idem, idempotency.Config{Consumer: name})
			require.NoError(t, err)
			mws = append(mws, dedup.Middleware)
		}
		router.AddConsumerHandler(name, topic, subscriber(name), func(m *message.Message) error { _, err := apply(m); return err }).AddMiddleware(mws...)
	}
	router.AddConsumerHandler("dlq-recorder", dlq.DefaultTopic(topic), subscriber("recorder"), store.Record)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	select {
	case <-router.Running():
	case <-time.After(60 * time.Second):
		t.Fatal("router did not start")
	}

	effects := func(g string) int {
		return pgtest.Column[int](t, db, `SELECT count(*)::int FROM effects_`+g+` WHERE event_id = 'order-42'`)[0]
	}
	order := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
	order.Metadata.Set(metadata.EventID, "order-42")
	start := time.Now()
	require.NoError(t, ps.Publish(topic, order))
	var rows []dlq.DeadLetter
	poll.Until(t, 120*time.Second, func() bool {
		rows, err = store.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		return len(rows) == 1 && effects("ledger") == 1 && effects("audit") == 1
	}, "ledger and audit applied order 42, billing dead-lettered it")
	t.Logf("%s: original applied and dead-lettered after %s", topic, time.Since(start))
	require.Equal(t, "billing", rows[0].ConsumerGroup)
	require.Equal(t, "billing", rows[0].Handler)
	require.EqualValues(t, 1, refused.Load(), "a permanent error: one attempt")
	require.Zero(t, effects("billing"))

	// Days later: ledger's mark expired (retention.DefaultIdempotencyRetention is
	// shorter than the dead letters' 90 days); billing was fixed.
	res, err := db.Exec(`DELETE FROM millwright_processed_events WHERE consumer = 'ledger'`)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "ledger's mark existed and is gone")
	billingRefuses.Store(false)

	rep, err := replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: []int64{rows[0].ID}}})
	require.NoError(t, err)
	require.Len(t, rep.Items, 1)
	require.Equal(t, dlq.ReplayTarget("billing", "billing"), rep.Items[0].For)
	relayQueued(t, store, ps)
	poll.Until(t, 120*time.Second, func() bool {
		return groups["ledger"].replays.Load() == 1 && groups["audit"].replays.Load() == 1 && groups["billing"].replays.Load() == 1
	}, "every group acked the replay")
	t.Logf("%s: replay acked by every group after %s", topic, time.Since(start))

	require.Equal(t, 1, effects("billing"), "the group that dead-lettered it applies the replay once")
	require.Equal(t, 1, effects("ledger"), "a group that applied the original does not apply the replay, mark or no mark")
	require.Equal(t, 1, effects("audit"), "a group without idempotency does not apply the replay")
	require.EqualValues(t, 1, groups["ledger"].mw.Stats().ReplaysSkipped)
	require.EqualValues(t, 1, groups["audit"].mw.Stats().ReplaysSkipped)
	require.Zero(t, groups["billing"].mw.Stats().ReplaysSkipped)
	require.EqualValues(t, 1, testCounter(t, reg, dlq.MetricReplaysSkipped, map[string]string{"topic": topic, "consumer_group": "ledger", "handler": "ledger"}))
	require.EqualValues(t, 1, testCounter(t, reg, dlq.MetricReplaysSkipped, map[string]string{"topic": topic, "consumer_group": "audit", "handler": "audit"}))
}

// testCounter reads the counter name with exactly labels from reg (0 if
// absent).
func testCounter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	metric:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue metric
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// A dead letter that records no consumer (a row from before consumers
// were recorded) replays to every consumer of its topic, as it always
// did, and says so; a replay to another topic (ReplayOptions.Target) is
// for whoever consumes that topic.
func TestReplayWithoutARecordedConsumerIsForEveryConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store, _ := newStore(t)
	old := deadLetter("orders", "boom", time.Now())
	old.Metadata.Set(metadata.DeadLetterConsumerGroup, "")
	old.Metadata.Set(metadata.DeadLetterHandler, "")
	recorded := deadLetter("orders", "boom", time.Now())
	ids := insert(t, store, old, recorded)
	rep, err := replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: ids}})
	require.NoError(t, err)
	require.Len(t, rep.Items, 2)
	require.Empty(t, rep.Items[0].For)
	require.Equal(t, "billing/h", rep.Items[1].For)
	sent := queued(t, store)
	require.Len(t, sent, 2)
	_, has := sent[0].msg.Metadata[metadata.DeadLetterReplayFor]
	require.False(t, has, "no target: every consumer runs it")
	require.Equal(t, "billing/h", sent[1].msg.Metadata.Get(metadata.DeadLetterReplayFor))

	rep, err = replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: ids[1:]}, Target: "orders.retry", Force: true})
	require.NoError(t, err)
	require.Empty(t, rep.Items[0].For)
	_, has = queued(t, store)[2].msg.Metadata[metadata.DeadLetterReplayFor]
	require.False(t, has, "a replay to another topic is for that topic's consumers")
}

// ReplayOptions.For overrides the recorded consumer: a renamed consumer's
// new name, or every consumer.
func TestReplayForOverridesTheRecordedConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store, _ := newStore(t)
	ids := insert(t, store, deadLetter("orders", "boom", time.Now()))
	_, err := replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: ids}, For: "billing"})
	require.ErrorContains(t, err, `replay for "billing": want`)
	require.Empty(t, queued(t, store))

	rep, err := replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: ids}, For: dlq.ReplayTarget("billing-v2", "h")})
	require.NoError(t, err)
	require.Equal(t, "billing-v2/h", rep.Items[0].For)
	require.Equal(t, "billing-v2/h", queued(t, store)[0].msg.Metadata.Get(metadata.DeadLetterReplayFor))

	rep, err = replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{IDs: ids}, For: dlq.ReplayEveryConsumer, Force: true})
	require.NoError(t, err)
	require.Empty(t, rep.Items[0].For)
	_, has := queued(t, store)[1].msg.Metadata[metadata.DeadLetterReplayFor]
	require.False(t, has)
}

func TestReplayTargetIsUnambiguous(t *testing.T) {
	t.Parallel()
	require.Equal(t, "", dlq.ReplayTarget("", ""))
	require.Equal(t, "billing/charge", dlq.ReplayTarget("billing", "charge"))
	require.NotEqual(t, dlq.ReplayTarget("a/b", "c"), dlq.ReplayTarget("a", "b/c"))
	require.Equal(t, "/charge", dlq.ReplayTarget("", "charge"))
}
