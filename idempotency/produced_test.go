package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/retry"
)

// flakyPublisher fails its first failures Publish calls, then publishes
// through the wrapped publisher. It records the metadata.EventID of every
// message it was asked to publish, failed attempts included.
type flakyPublisher struct {
	message.Publisher
	left, failed atomic.Int32
	mu           sync.Mutex
	attempted    []string // every message's event id, in order
	failedIDs    []string // those of the failed calls
}

func newFlaky(pub message.Publisher, failures int32) *flakyPublisher {
	p := &flakyPublisher{Publisher: pub}
	p.left.Store(failures)
	return p
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	for _, m := range msgs {
		p.attempted = append(p.attempted, m.Metadata.Get(metadata.EventID))
	}
	fail := p.left.Add(-1) >= 0
	if fail {
		p.failed.Add(1)
		for _, m := range msgs {
			p.failedIDs = append(p.failedIDs, m.Metadata.Get(metadata.EventID))
		}
	}
	p.mu.Unlock()
	if fail {
		return testError("broker unavailable (injected)")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *flakyPublisher) failedAttempts() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.failedIDs...)
}

func (p *flakyPublisher) attempts() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.attempted...)
}

// The handler's produced messages survive a publish that fails once,
// counted on the consumer's side: through a real Router, in both modes, on
// both stores, to both destinations (the outbox only on Postgres), the
// follow-up of every event reaches a downstream subscriber, and the effect
// is applied once where the mode promises it. Before the fix the router
// published them after the mark committed: the failed publish nacked the
// message, the redelivery was skipped as a duplicate, and the follow-up of
// the first event never arrived.
func TestProducedMessagesSurviveAFailedPublish(t *testing.T) {
	t.Parallel()
	type variant struct {
		mode   idempotency.Mode
		store  string // "memory" or "postgres"
		outbox bool   // ProducedToOutbox, else ProducedPublisher
	}
	var variants []variant
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		variants = append(variants,
			variant{mode, "memory", false}, variant{mode, "postgres", false}, variant{mode, "postgres", true})
	}
	for _, v := range variants {
		sink := "publisher"
		if v.outbox {
			sink = "outbox"
		}
		t.Run(fmt.Sprintf("%s/%s/%s", v.mode, v.store, sink), func(t *testing.T) {
			t.Parallel()
			const events = 3
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			logger := watermill.NopLogger{}
			pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 64}, logger)
			t.Cleanup(func() { _ = pubSub.Close() })
			flaky := newFlaky(pubSub, 1)

			var store idempotency.Store = idempotency.NewMemoryStore()
			var schema *pgtest.Schema
			if v.store == "postgres" {
				schema = pgtest.New(t, idempotency.Migrations(), outbox.Migrations())
				_, err := schema.DB.Exec(`CREATE TABLE effects (consumer TEXT NOT NULL, event_id TEXT NOT NULL)`)
				require.NoError(t, err)
				pg, err := idempotency.NewPostgresStore(pgconnPool(t, schema))
				require.NoError(t, err)
				store = pg
			}
			cfg := idempotency.Config{Consumer: "billing", Mode: v.mode}
			if v.outbox {
				// The relay's publisher is the one that fails once.
				cfg.ProducedToOutbox, cfg.ProducedTopic = true, "invoices"
				relay, err := outbox.NewRelay(schema.DB, flaky, outbox.RelayConfig{
					PollInterval: 10 * time.Millisecond,
					Retry:        retry.Policy{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
				})
				require.NoError(t, err)
				relayErr := make(chan error, 1)
				go func() { relayErr <- relay.Run(ctx) }()
				t.Cleanup(func() {
					require.NoError(t, relay.Close())
					<-relayErr
				})
			} else {
				// The topic is the router handler's publish topic.
				cfg.ProducedPublisher = flaky
			}
			m, _ := newMiddleware(t, store, cfg)

			// The consumer downstream of the follow-ups.
			downstream, err := pubSub.Subscribe(ctx, "invoices")
			require.NoError(t, err)
			received := make(chan *message.Message, 100)
			go func() {
				for f := range downstream {
					f.Ack()
					received <- f
				}
			}()

			var runs, externalEffects atomic.Int32
			acked := make(chan string, 4*events)
			router, err := message.NewRouter(message.RouterConfig{}, logger)
			require.NoError(t, err)
			h := func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				id := msg.Metadata.Get(metadata.EventID)
				if tx, ok := idempotency.TxFromContext(msg.Context()); ok {
					if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effects (consumer, event_id) VALUES ('billing', $1)`, id); err != nil {
						return nil, err
					}
				} else {
					externalEffects.Add(1) // an HTTP call, say: nothing rolls it back
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice for "+id))}, nil
			}
			// The router's own publisher is never given a message.
			router.AddHandler("billing", "orders", pubSub, "invoices", neverPublisher{t}, h).
				AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
					return func(msg *message.Message) ([]*message.Message, error) {
						out, err := next(msg)
						if err == nil {
							acked <- msg.Metadata.Get(metadata.EventID)
						}
						return out, err
					}
				}, m.Middleware)
			runErr := make(chan error, 1)
			go func() { runErr <- router.Run(ctx) }()
			t.Cleanup(func() {
				require.NoError(t, router.Close())
				require.NoError(t, receive(t, runErr, "the router to stop"))
			})
			receive(t, router.Running(), "the router to run")

			for i := range events {
				require.NoError(t, pubSub.Publish("orders", idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
			}
			ackDeadline := time.After(30 * time.Second)
			for i := range events {
				select {
				case <-acked:
				case <-ackDeadline:
					t.Fatalf("timed out after 30s: %d of %d inputs handled without error; handler ran %d times, publisher failed %d times",
						i, events, runs.Load(), flaky.failed.Load())
				}
			}
			followUps := map[string]int{} // by payload: the consumed event
			ids := map[string]string{}    // payload -> ce_id of its copies
			deadline := time.After(30 * time.Second)
			for len(followUps) < events {
				select {
				case f := <-received:
					p := string(f.Payload)
					followUps[p]++
					id := f.Metadata.Get(metadata.EventID)
					require.NotEmpty(t, id, "follow-up %q has an event id", p)
					if prev, ok := ids[p]; ok {
						require.Equal(t, prev, id, "copies of the follow-up %q share its event id", p)
					}
					ids[p] = id
				case <-deadline:
					t.Fatalf("timed out after 30s: follow-ups received %v of %d events; handler ran %d times, publisher failed %d times",
						followUps, events, runs.Load(), flaky.failed.Load())
				}
			}

			require.EqualValues(t, 1, flaky.failed.Load(), "the injected publish failure happened")
			for i := range events {
				require.GreaterOrEqual(t, followUps[fmt.Sprintf("invoice for evt-%d", i)], 1, "follow-up of evt-%d received", i)
				seen, err := store.Processed(ctx, "billing", fmt.Sprintf("evt-%d", i))
				require.NoError(t, err)
				require.True(t, seen, "evt-%d marked", i)
			}
			require.EqualValues(t, events, m.Stats().Processed)
			if v.outbox {
				// The relay retried its publish: the handler ran once per event.
				require.EqualValues(t, events, runs.Load(), "handler runs")
			} else {
				// The failed publish failed the message: its event ran twice.
				require.EqualValues(t, events+1, runs.Load(), "handler runs")
				attempts, failed := flaky.attempts(), flaky.failedAttempts()
				require.Len(t, attempts, events+1)
				require.Len(t, failed, 1)
				sameID := 0
				for _, id := range attempts {
					if id == failed[0] {
						sameID++
					}
				}
				require.Equal(t, 2, sameID, "the republished copy has the failed one's event id %s: attempts %v", failed[0], attempts)
				for _, id := range ids {
					require.Contains(t, attempts, id, "a delivered follow-up's event id was attempted")
				}
			}
			if schema != nil && v.mode == idempotency.Transactional {
				require.Equal(t, events, countRows(t, schema.DB, `SELECT count(*) FROM effects`), "effects applied once each")
				require.Equal(t, events, countRows(t, schema.DB, `SELECT count(DISTINCT event_id) FROM effects`))
			} else {
				// No transaction to roll back: each run's effect happened,
				// as the package doc says for this mode or store.
				require.EqualValues(t, runs.Load(), externalEffects.Load())
			}
		})
	}
}

// neverPublisher is the router handler's publisher: the middleware returns
// no messages to the router, so it must never be called.
type neverPublisher struct{ t *testing.T }

func (p neverPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.t.Errorf("the router published %d produced message(s) to %q after the mark committed", len(msgs), topic)
	return nil
}

func (neverPublisher) Close() error { return nil }

// A handler that returns messages with no destination configured fails
// permanently, naming the fields to set, and leaves no mark (nor, in
// Transactional mode, its effect): the message goes to the dead-letter
// path and, replayed after the fix, is processed. Before the fix the
// messages went back to the router and the mark committed.
func TestProducedWithoutDestinationFails(t *testing.T) {
	t.Parallel()
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			stores(t, func(t *testing.T, store idempotency.Store) {
				produce := func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
				}
				m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode})
				out, err := m.Middleware(produce)(idempotencytest.NewMessage("evt-1", nil))
				require.ErrorIs(t, err, idempotency.ErrNoProducedDestination)
				require.True(t, retry.IsPermanent(err), "retrying cannot configure a destination")
				require.ErrorContains(t, err, "Config.ProducedToOutbox")
				require.ErrorContains(t, err, "Config.ProducedPublisher")
				require.Empty(t, out, "nothing goes back to the router")
				seen, err := store.Processed(bg, "billing", "evt-1")
				require.NoError(t, err)
				require.False(t, seen, "no mark: a replay after the fix processes the event")

				// A publisher but no topic (no router handler, no ProducedTopic).
				pub := newFlaky(gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}), 0)
				m, _ = newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode, ProducedPublisher: pub})
				_, err = m.Middleware(produce)(idempotencytest.NewMessage("evt-1", nil))
				require.ErrorIs(t, err, idempotency.ErrNoProducedDestination)
				require.True(t, retry.IsPermanent(err))
				require.ErrorContains(t, err, "Config.ProducedTopic")
				require.Empty(t, pub.attempts())
				seen, err = store.Processed(bg, "billing", "evt-1")
				require.NoError(t, err)
				require.False(t, seen)

				// A handler that returns nothing needs no destination.
				m, _ = newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode})
				_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(idempotencytest.NewMessage("evt-1", nil))
				require.NoError(t, err)
			})
		})
	}
}

// In Transactional mode the effect written before a refused follow-up
// rolls back with the mark.
func TestProducedWithoutDestinationRollsBackEffect(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	write := effectHandler("billing")
	_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := write(msg); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
	})(idempotencytest.NewMessage("evt-1", nil))
	require.ErrorIs(t, err, idempotency.ErrNoProducedDestination)
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM effects`), "effect rolled back")
	require.Zero(t, countRows(t, b.schema.DB, `SELECT count(*) FROM millwright_processed_events`), "mark rolled back")
}

// In both modes the outbox rows of the follow-ups commit with the mark: a
// follow-up the outbox refuses fails the message permanently with no mark
// and no row; two deliveries of one event finishing at once in
// MarkAfterSuccess mode write one set of follow-ups.
func TestProducedToOutboxCommitsWithTheMark(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testProducedToOutboxCommitsWithTheMark(t, driver)
	})
}

func testProducedToOutboxCommitsWithTheMark(t *testing.T, driver string) {
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			s := pgtest.New(t, idempotency.Migrations(), outbox.Migrations())
			store, err := idempotency.NewPostgresStore(s.DB)
			if driver == pgtest.DriverPgx {
				store, err = idempotency.NewPostgresStore(s.Pgx(t))
			}
			require.NoError(t, err)
			m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode, ProducedToOutbox: true, ProducedTopic: "invoices"})

			bad := message.NewMessage(watermill.NewUUID(), nil)
			bad.Metadata.Set("bad\x00key", "v") // Postgres text cannot hold NUL
			_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil), bad}, nil
			})(idempotencytest.NewMessage("evt-bad", nil))
			require.ErrorIs(t, err, outbox.ErrInvalidEvent)
			require.True(t, retry.IsPermanent(err), "the same follow-up fails every run")
			require.Zero(t, countRows(t, s.DB, `SELECT count(*) FROM millwright_outbox`))
			require.Zero(t, countRows(t, s.DB, `SELECT count(*) FROM millwright_processed_events`))

			var runs atomic.Int32
			follow := func(*message.Message) ([]*message.Message, error) {
				runs.Add(1)
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{"n":1}`))}, nil
			}
			h := m.Middleware(follow)
			outer := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				out, _ := follow(msg)
				if mode == idempotency.MarkAfterSuccess {
					// A second delivery of the event completes while this
					// one runs (in Transactional mode it would wait on the
					// mark: not here).
					_, err := h(idempotencytest.NewMessage("evt-1", nil))
					require.NoError(t, err)
				}
				return out, nil
			})
			_, err = outer(idempotencytest.NewMessage("evt-1", nil))
			require.NoError(t, err)
			_, err = h(idempotencytest.NewMessage("evt-1", nil)) // a later redelivery
			require.NoError(t, err)
			require.Equal(t, 1, countRows(t, s.DB, `SELECT count(*) FROM millwright_outbox WHERE topic = 'invoices'`), "one follow-up for the event")
			require.Equal(t, 1, countRows(t, s.DB, `SELECT count(*) FROM millwright_processed_events`))
			if mode == idempotency.MarkAfterSuccess {
				require.EqualValues(t, 2, runs.Load(), "both concurrent deliveries ran")
				require.EqualValues(t, 1, m.Stats().RepeatedEffects)
			}
		})
	}
}
