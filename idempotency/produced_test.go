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

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
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
	var variants []producedVariant
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		variants = append(variants,
			producedVariant{mode, "memory", false}, producedVariant{mode, "postgres", false}, producedVariant{mode, "postgres", true})
	}
	for _, v := range variants {
		sink := "publisher"
		if v.outbox {
			sink = "outbox"
		}
		t.Run(fmt.Sprintf("%s/%s/%s", v.mode, v.store, sink), func(t *testing.T) {
			t.Parallel()
			testProducedSurviveAFailedPublish(t, v)
		})
	}
}

// producedVariant is one case of TestProducedMessagesSurviveAFailedPublish.
type producedVariant struct {
	mode   idempotency.Mode
	store  string // "memory" or "postgres"
	outbox bool   // ProducedToOutbox, else ProducedPublisher
}

// producedEvents is how many events each variant consumes.
const producedEvents = 3

// producedRun is what one variant sets up and observes.
type producedRun struct {
	v                     producedVariant
	ctx                   context.Context
	pubSub                *gochannel.GoChannel
	flaky                 *flakyPublisher
	store                 idempotency.Store
	schema                *pgtest.Schema // nil on the memory store
	m                     *idempotency.Middleware
	received              chan *message.Message // the follow-ups downstream
	acked                 chan string           // inputs handled without error
	runs, externalEffects atomic.Int32
}

func testProducedSurviveAFailedPublish(t *testing.T, v producedVariant) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r := &producedRun{v: v, ctx: ctx}
	r.pubSub = gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { _ = r.pubSub.Close() })
	r.flaky = newFlaky(r.pubSub, 1)
	r.setupStore(t)
	r.m, _ = newMiddleware(t, r.store, r.config(t))
	r.subscribeDownstream(t)
	r.runRouter(t)

	for i := range producedEvents {
		require.NoError(t, r.pubSub.Publish("orders", idempotencytest.NewMessage(fmt.Sprintf("evt-%d", i), nil)))
	}
	r.awaitAcks(t)
	followUps, ids := r.collectFollowUps(t)
	r.check(t, followUps, ids)
}

func (r *producedRun) setupStore(t *testing.T) {
	r.store = idempotency.NewMemoryStore()
	if r.v.store != "postgres" {
		return
	}
	r.schema = pgtest.New(t, idempotency.Migrations(), outbox.Migrations())
	_, err := r.schema.DB.Exec(`CREATE TABLE effects (consumer TEXT NOT NULL, event_id TEXT NOT NULL)`)
	require.NoError(t, err)
	pg, err := idempotency.NewPostgresStore(postgres.From(pgconnPool(t, r.schema)))
	require.NoError(t, err)
	r.store = pg
}

// config is the middleware's: the follow-ups go to the flaky publisher,
// or to the outbox whose relay publishes through it.
func (r *producedRun) config(t *testing.T) idempotency.Config {
	cfg := idempotency.Config{Consumer: "billing", Mode: r.v.mode}
	if !r.v.outbox {
		// The topic is the router handler's publish topic.
		cfg.ProducedPublisher = r.flaky
		return cfg
	}
	// The relay's publisher is the one that fails once.
	cfg.ProducedToOutbox, cfg.ProducedTopic = true, "invoices"
	rel, err := relay.New(postgres.From(r.schema.DB), r.flaky, relay.Config{
		PollInterval: 10 * time.Millisecond,
		Retry:        retry.Policy{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
	})
	require.NoError(t, err)
	relayErr := make(chan error, 1)
	go func() { relayErr <- rel.Run(r.ctx) }()
	t.Cleanup(func() {
		require.NoError(t, rel.Close())
		<-relayErr
	})
	return cfg
}

// subscribeDownstream starts the consumer downstream of the follow-ups.
func (r *producedRun) subscribeDownstream(t *testing.T) {
	downstream, err := r.pubSub.Subscribe(r.ctx, "invoices")
	require.NoError(t, err)
	r.received = make(chan *message.Message, 100)
	go func() {
		for f := range downstream {
			f.Ack()
			r.received <- f
		}
	}()
}

// handle is the handler: its effect, then one follow-up.
func (r *producedRun) handle(msg *message.Message) ([]*message.Message, error) {
	r.runs.Add(1)
	id := msg.Metadata.Get(metadata.EventID)
	if pt, ok := idempotency.TxFromContext(msg.Context()); ok && pt.SQL() != nil {
		tx := pt.SQL()
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effects (consumer, event_id) VALUES ('billing', $1)`, id); err != nil {
			return nil, err
		}
	} else {
		r.externalEffects.Add(1) // an HTTP call, say: nothing rolls it back
	}
	return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice for "+id))}, nil
}

func (r *producedRun) runRouter(t *testing.T) {
	r.acked = make(chan string, 4*producedEvents)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	// The router's own publisher is never given a message.
	router.AddHandler("billing", "orders", r.pubSub, "invoices", neverPublisher{t}, r.handle).
		AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := next(msg)
				if err == nil {
					r.acked <- msg.Metadata.Get(metadata.EventID)
				}
				return out, err
			}
		}, r.m.Middleware)
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(r.ctx) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, receive(t, runErr, "the router to stop"))
	})
	receive(t, router.Running(), "the router to run")
}

func (r *producedRun) awaitAcks(t *testing.T) {
	ackDeadline := time.After(30 * time.Second)
	for i := range producedEvents {
		select {
		case <-r.acked:
		case <-ackDeadline:
			t.Fatalf("timed out after 30s: %d of %d inputs handled without error; handler ran %d times, publisher failed %d times",
				i, producedEvents, r.runs.Load(), r.flaky.failed.Load())
		}
	}
}

// collectFollowUps waits for a follow-up of every event: their counts and
// event ids by payload (the consumed event).
func (r *producedRun) collectFollowUps(t *testing.T) (followUps map[string]int, ids map[string]string) {
	followUps = map[string]int{} // by payload: the consumed event
	ids = map[string]string{}    // payload -> ce_id of its copies
	deadline := time.After(30 * time.Second)
	for len(followUps) < producedEvents {
		select {
		case f := <-r.received:
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
				followUps, producedEvents, r.runs.Load(), r.flaky.failed.Load())
		}
	}
	return followUps, ids
}

func (r *producedRun) check(t *testing.T, followUps map[string]int, ids map[string]string) {
	const events = producedEvents
	require.EqualValues(t, 1, r.flaky.failed.Load(), "the injected publish failure happened")
	for i := range events {
		require.GreaterOrEqual(t, followUps[fmt.Sprintf("invoice for evt-%d", i)], 1, "follow-up of evt-%d received", i)
		seen, err := r.store.Processed(r.ctx, "billing", fmt.Sprintf("evt-%d", i))
		require.NoError(t, err)
		require.True(t, seen, "evt-%d marked", i)
	}
	require.EqualValues(t, events, r.m.Stats().Processed)
	if r.v.outbox {
		// The relay retried its publish: the handler ran once per event.
		require.EqualValues(t, events, r.runs.Load(), "handler runs")
	} else {
		r.checkRepublished(t, ids)
	}
	if r.schema != nil && r.v.mode == idempotency.Transactional {
		require.Equal(t, events, countRows(t, r.schema.DB, `SELECT count(*) FROM effects`), "effects applied once each")
		require.Equal(t, events, countRows(t, r.schema.DB, `SELECT count(DISTINCT event_id) FROM effects`))
	} else {
		// No transaction to roll back: each run's effect happened,
		// as the package doc says for this mode or store.
		require.EqualValues(t, r.runs.Load(), r.externalEffects.Load())
	}
}

// checkRepublished: the failed publish failed the message, so its event
// ran twice, and the republished copy kept the failed one's event id.
func (r *producedRun) checkRepublished(t *testing.T, ids map[string]string) {
	const events = producedEvents
	require.EqualValues(t, events+1, r.runs.Load(), "handler runs")
	attempts, failed := r.flaky.attempts(), r.flaky.failedAttempts()
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
				require.True(t, failure.IsPermanent(err), "retrying cannot configure a destination")
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
				require.True(t, failure.IsPermanent(err))
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
			store, err := idempotency.NewPostgresStore(postgres.From(s.DB))
			if driver == pgtest.DriverPgx {
				store, err = idempotency.NewPostgresStore(postgres.From(s.Pgx(t)))
			}
			require.NoError(t, err)
			m, _ := newMiddleware(t, store, idempotency.Config{Consumer: "billing", Mode: mode, ProducedToOutbox: true, ProducedTopic: "invoices"})

			bad := message.NewMessage(watermill.NewUUID(), nil)
			bad.Metadata.Set("bad\x00key", "v") // Postgres text cannot hold NUL
			_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil), bad}, nil
			})(idempotencytest.NewMessage("evt-bad", nil))
			require.ErrorIs(t, err, outbox.ErrInvalidEvent)
			require.True(t, failure.IsPermanent(err), "the same follow-up fails every run")
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
