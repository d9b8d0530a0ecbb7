package park_test

// Where park meets the DLQ, the operator and binary data (issue 40): a
// replayed or edited dead letter of a held key is applied in its key's
// place; a dead letter applied later through park is resolved; binary
// keys and metadata stay bytes; a round that outlives its lease is not
// run twice; one bad record does not kill the retrier.

import (
	"context"
	"errors"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/park"
)

// ledger is a consumer's table: the payloads applied, by message UUID, in
// apply order. A payload "bad" is refused permanently (a business rule).
type ledger struct {
	mu      sync.Mutex
	applied []string // "uuid=payload"
	refused atomic.Int64
}

func (l *ledger) handle(m *message.Message) ([]*message.Message, error) {
	if string(m.Payload) == "bad" {
		l.refused.Add(1)
		return nil, failure.Permanent(errors.New("payload refused by business rule"))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.applied = append(l.applied, m.UUID+"="+string(m.Payload))
	return nil, nil
}

func (l *ledger) list() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.applied...)
}

func raw(uuid, key, payload string) *message.Message {
	m := message.NewMessage(uuid, []byte(payload))
	m.Metadata.Set(metadata.OrderingKey, key)
	m.SetContext(context.Background())
	return m
}

// A dead letter replayed (`millwright dlq replay`, same UUID, same
// payload, after the handler was fixed) or edited (a new payload, same
// UUID, as the console's edit and replay sends it) while its key is held
// is applied in its key's place, before the key's later messages; the
// operator's later `parked release` finds nothing held.
func TestReplayedDeadLetterOfHeldKeyIsApplied(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"replay", "edit"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
				t.Parallel()
				b := setup(t, driver)
				l := &ledger{}
				p := b.parker(t, park.Config{})
				refuseOnce := atomic.Bool{}
				refuseOnce.Store(true)
				h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
					if how == "replay" && m.UUID == "k1" && refuseOnce.Load() {
						l.refused.Add(1)
						return nil, failure.Permanent(errors.New("handler bug"))
					}
					return l.handle(m)
				})
				ctx := context.Background()
				first := "k1-v1"
				if how == "edit" {
					first = "bad"
				}
				deliver(t, h, raw("k1", "k", first))
				deliver(t, h, raw("k2", "k", "k2-v1"))
				require.EqualValues(t, 1, l.refused.Load(), "k1 was refused once")
				ks := b.keys(t)
				require.Len(t, ks, 1)
				require.True(t, ks[0].Held, "k1 dead-lettered: key k held")
				dls, err := b.dlq.List(ctx, dlq.Filter{})
				require.NoError(t, err)
				require.Len(t, dls, 1)

				if how == "replay" {
					refuseOnce.Store(false) // the handler is fixed, then the dead letter replayed
					rep, err := b.replay(t, h, dlq.ReplayOptions{Target: "orders"})
					require.NoError(t, err)
					require.Len(t, rep.Items, 1)
				} else {
					// The console's edited copy: original UUID and metadata,
					// the operator's payload, the dead letter's id.
					m := raw("k1", "k", "k1-fixed")
					m.Metadata.Set(metadata.DeadLetterReplayOf, strconv.FormatInt(dls[0].ID, 10))
					deliver(t, h, m)
				}
				b.drain(t, p, nil)
				// The operator releases the key afterwards, as the runbook
				// says; nothing is held any more.
				err = b.store.Release(ctx, "billing", "k", false)
				require.ErrorIs(t, err, park.ErrNotParked)
				want := []string{"k1=k1-v1", "k2=k2-v1"}
				if how == "edit" {
					want = []string{"k1=k1-fixed", "k2=k2-v1"}
				}
				require.Equal(t, want, l.list(), "the replayed dead letter is applied once, in its key's place")
			})
		})
	}
}

// A dead letter whose message is applied later through park (`parked
// retry`, then the retrier) is resolved: out of `dlq list`'s dead ones and
// the depth, with an audit row.
func TestDeadLetterAppliedThroughParkIsResolved(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		cfg := park.Config{}
		cfg.Retry = fast
		cfg.Retry.MaxAttempts = 2
		p := b.parker(t, cfg)
		h := chain(t, p, "billing", a.handle)
		ctx := context.Background()
		a.fail("r1")
		deliver(t, h, msg("r1", "r"))
		deliver(t, h, msg("r2", "r"))
		b.drain(t, p, func() bool { return p.Stats().DeadLetters == 1 })
		// And one refused permanently on first delivery (held at once).
		a.mu.Lock()
		a.permanent["s1"] = true
		a.mu.Unlock()
		deliver(t, h, msg("s1", "s"))
		depth, err := b.dlq.Depth(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 2, depth[""], "two dead letters before the retries")

		a.heal("r1")
		a.mu.Lock()
		delete(a.permanent, "s1")
		a.mu.Unlock()
		require.NoError(t, b.store.Retry(ctx, "billing", "r"))
		require.NoError(t, b.store.Retry(ctx, "billing", "s"))
		b.drain(t, p, nil)
		require.Equal(t, []string{"r1", "r2"}, a.order(isKey("r")))
		require.Equal(t, []string{"s1"}, a.order(isKey("s")))

		dls, err := b.dlq.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		require.Len(t, dls, 2)
		for _, d := range dls {
			require.Equal(t, "resolved", d.State, "%s was applied through park", d.MessageUUID)
		}
		depth, err = b.dlq.Depth(ctx)
		require.NoError(t, err)
		require.Zero(t, depth[""], "a resolved dead letter leaves the depth")
		pending, err := b.dlq.Count(ctx, dlq.Filter{Pending: true})
		require.NoError(t, err)
		require.Zero(t, pending, "nor is it pending replay")
		var audits int
		require.NoError(t, b.schema.DB.QueryRow(`SELECT count(*) FROM millwright_audit WHERE command = 'park resolve dead letter' AND affected = 1`).Scan(&audits))
		require.Equal(t, 2, audits, "each resolution is audited")
	})
}

func binaryKey(m *message.Message) string { return m.Metadata.Get("bin_key") }

// Two binary keys that differ only in bytes that are not UTF-8 are two
// lanes: the second runs while the first is parked. Binary metadata (not
// UTF-8, NUL) reaches a retried handler byte for byte.
func TestBinaryKeysAndMetadataStayBytes(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		var (
			mu   sync.Mutex
			seen = map[string][]message.Metadata{}
			fail = map[string]bool{"x1": true}
		)
		p := b.parker(t, park.Config{Key: binaryKey})
		h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
			mu.Lock()
			defer mu.Unlock()
			seen[m.UUID] = append(seen[m.UUID], maps.Clone(m.Metadata))
			if fail[m.UUID] {
				return nil, errTransient
			}
			return nil, nil
		})
		k1, k2 := "\x0a\xff\x01", "\x0a\xfe\x01"
		m1 := message.NewMessage("x1", []byte("one"))
		m1.Metadata.Set("bin_key", k1)
		m1.Metadata.Set("trace\xff", "a\x00b\xfe\xc3")
		m1.SetContext(context.Background())
		want := maps.Clone(m1.Metadata)
		deliver(t, h, m1)
		m2 := message.NewMessage("y1", []byte("two"))
		m2.Metadata.Set("bin_key", k2)
		m2.SetContext(context.Background())
		deliver(t, h, m2)
		mu.Lock()
		require.Len(t, seen["y1"], 1, "key %x ran while key %x was parked", k2, k1)
		fail["x1"] = false
		mu.Unlock()
		b.drain(t, p, nil)
		mu.Lock()
		defer mu.Unlock()
		runs := seen["x1"]
		require.Len(t, runs, 3, "two in place, then one round")
		require.Equal(t, want, runs[2], "the retried message's metadata is byte-identical")
		ks := b.keys(t)
		require.Empty(t, ks)
	})
}

// A message without a key is parked alone: a message whose real key is
// the text "uuid:<that message's UUID>" is not parked behind it.
func TestKeylessLaneIsNotARealKey(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{})
		h := chain(t, p, "billing", a.handle)
		a.fail("n1")
		keyless := message.NewMessage("n1", []byte("{}"))
		keyless.SetContext(context.Background())
		deliver(t, h, keyless)
		deliver(t, h, msg("real", "uuid:n1"))
		require.Equal(t, []string{"real"}, a.appliedList(), `the key "uuid:n1" is not the keyless message's lane`)
		a.heal("n1")
		b.drain(t, p, nil)
		require.ElementsMatch(t, []string{"real", "n1"}, a.appliedList())
	})
}

// A round that outlives Config.Lease on a live retrier keeps its claim
// (the retrier extends it while the handler runs): no second retrier runs
// the head meanwhile, and the key's next message is applied after it. A
// consumer that marks after success (the app here) would otherwise apply
// k1's effect again, after k2's.
func TestRoundLongerThanLeaseRunsOnce(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		var (
			mu       sync.Mutex
			effects  []string
			inFlight atomic.Int32
			overlap  atomic.Int32
			calls    atomic.Int32
			release  = make(chan struct{})
			started  = make(chan struct{}, 8)
		)
		handle := func(m *message.Message) ([]*message.Message, error) {
			if m.UUID == "k1" {
				if calls.Add(1) == 1 {
					return nil, failure.Permanent(errors.New("first delivery fails")) // parks (held) below
				}
				if inFlight.Add(1) > 1 {
					overlap.Add(1)
				}
				defer inFlight.Add(-1)
				started <- struct{}{}
				<-release
			}
			mu.Lock()
			effects = append(effects, m.UUID)
			mu.Unlock()
			return nil, nil
		}
		cfg := park.Config{Lease: time.Second, PollInterval: 10 * time.Millisecond, Concurrency: 4}
		first, second := b.parker(t, cfg), b.parker(t, cfg)
		h := chain(t, first, "billing", handle)
		_ = second.Middleware("billing")(handle)
		deliver(t, h, raw("k1", "k", "one"))
		deliver(t, h, raw("k2", "k", "two"))
		ctx := context.Background()
		require.NoError(t, b.store.Retry(ctx, "billing", "k"))
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var wg sync.WaitGroup
		for _, p := range []*park.Parker{first, second} {
			wg.Add(1)
			go func() { defer wg.Done(); _ = p.Run(ctx) }()
		}
		<-started
		claimedAt := time.Now()
		// Three leases pass with the round still running: without the
		// claim's extension the key is due again after one, and the other
		// retrier (or this one) starts k1 again.
		poll.Until(t, 60*time.Second, func() bool {
			return overlap.Load() > 0 || time.Since(claimedAt) > 3*cfg.Lease
		}, "three leases or a second run")
		close(release)
		poll.Until(t, 30*time.Second, func() bool { return len(b.keys(t)) == 0 }, "key k released")
		cancel()
		wg.Wait()
		require.Zero(t, overlap.Load(), "k1 ran twice at once: its claim passed to another round while it ran")
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, []string{"k1", "k2"}, effects, "k1's effect once, before k2's")
	})
}

// A retrier round that panics (in Config.Publish, or in a handler no
// middleware inside park recovers) or meets a row it cannot decode is
// recovered: Run goes on with the other keys, the record is held for an
// operator with the cause, and it is counted.
func TestRetrierSurvivesPanicAndBadRow(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		var published atomic.Int32
		reg := prometheus.NewRegistry()
		cfg := park.Config{Registerer: reg, PollInterval: 10 * time.Millisecond, Publish: func(string, []*message.Message) error {
			published.Add(1)
			panic("publisher bug")
		}}
		p := b.parker(t, cfg)
		h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
			if _, err := a.handle(m); err != nil {
				return nil, err
			}
			if m.UUID == "p1" {
				return []*message.Message{message.NewMessage("out", nil)}, nil
			}
			return nil, nil
		})
		// A handler without the retry middleware inside park: its panic
		// in a round reaches park.
		raw := p.Middleware("raw")(func(m *message.Message) ([]*message.Message, error) {
			if _, retried := park.Retried(m.Context()); retried {
				panic("handler bug")
			}
			return nil, errTransient
		})
		deliver(t, raw, msg("h1", "h"))
		a.fail("p1", "c1", "ok1")
		deliver(t, h, msg("p1", "p"))   // its round panics in Publish
		deliver(t, h, msg("c1", "c"))   // its row is corrupted below
		deliver(t, h, msg("ok1", "ok")) // an innocent key
		_, err := b.schema.DB.Exec(`UPDATE millwright_parked_messages SET metadata = '\xff'::bytea WHERE message_uuid = 'c1'`)
		if err != nil { // before the bytea migration: an undecodable JSON value
			_, err = b.schema.DB.Exec(`UPDATE millwright_parked_messages SET metadata = '[1]' WHERE message_uuid = 'c1'`)
		}
		require.NoError(t, err)
		a.heal("p1", "c1", "ok1")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		b.drainBy(t, func() bool {
			ks := b.keys(t)
			held := 0
			for _, k := range ks {
				if k.Held {
					held++
				}
			}
			return len(ks) == 3 && held == 3 && len(a.order(isKey("ok"))) == 1
		})
		require.GreaterOrEqual(t, published.Load(), int32(1), "the publisher panicked")
		for _, k := range b.keys(t) {
			switch k.Key {
			case "p":
				require.Contains(t, k.LastError, "publisher bug")
			case "c":
				require.Contains(t, k.LastError, "decoding")
			case "h":
				require.Contains(t, k.LastError, "handler bug")
			default:
				t.Fatalf("unexpected key %q", k.Key)
			}
		}
		require.EqualValues(t, 3, counted(t, reg, "millwright_park_set_aside_total"), "the three records set aside and counted")
		cancel()
		require.NoError(t, <-done)
	})
}

// counted returns the sum of the counter name's series in reg.
func counted(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// A dead letter with a binary key or header cannot be replayed through the
// outbox (its metadata is text): the replay is refused and changes
// nothing, and `millwright parked retry` applies the held head with every
// byte it had.
func TestReplayOfBinaryKeyedDeadLetterKeepsItsBytes(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		var (
			mu     sync.Mutex
			seen   []message.Metadata
			refuse = true
		)
		p := b.parker(t, park.Config{Key: binaryKey})
		h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, maps.Clone(m.Metadata))
			if refuse {
				return nil, failure.Permanent(errors.New("handler bug"))
			}
			return nil, nil
		})
		m := message.NewMessage("b1", []byte("one"))
		m.Metadata.Set("bin_key", "\x0a\xff\x01")
		m.Metadata.Set("trace\xfe", "v\xff")
		m.SetContext(context.Background())
		want := maps.Clone(m.Metadata)
		deliver(t, h, m)
		ks := b.keys(t)
		require.Len(t, ks, 1)
		require.True(t, ks[0].Held)
		require.Equal(t, "\x0a\xff\x01", ks[0].Key)
		dls, err := b.dlq.List(context.Background(), dlq.Filter{})
		require.NoError(t, err)
		require.Len(t, dls, 1)
		require.Equal(t, "b1", dls[0].MessageUUID)
		require.Equal(t, map[string]string(want), dls[0].Metadata, "the dead letter park wrote keeps the bytes (dlq migration 005)")

		mu.Lock()
		refuse = false
		mu.Unlock()
		// The outbox's metadata is text: the replay is refused rather than
		// sent with other bytes, and changes nothing.
		_, err = b.replay(t, h, dlq.ReplayOptions{Target: "orders"})
		require.ErrorIs(t, err, dlq.ErrNotReplayable)
		require.True(t, b.keys(t)[0].Held, "the key stays held")
		// `millwright parked retry` runs the held head from park's own
		// table, byte for byte.
		require.NoError(t, b.store.Retry(context.Background(), "billing", "\x0a\xff\x01"))
		b.drain(t, p, nil)
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, seen, 2, "refused once, then the retried head applied once")
		require.Equal(t, want, seen[1], "the retried head reached the handler with the original bytes")
	})
}

// The console's edited replay of a dead letter whose key the operator
// retried (`parked retry`) arrives while the retrier's round runs the
// key's head in its old form: it is nacked (the round could apply the old
// message, then delete the edited one with it), not acked as replaced.
// Redelivered after the round failed, it replaces the head, and the next
// round applies the edited payload, once.
func TestReplayWaitsForTheRunningRoundOfItsHead(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		l := &ledger{}
		p := b.parker(t, park.Config{})
		var (
			block   atomic.Bool
			blocked atomic.Int32
			started = make(chan struct{}, 8)
			release = make(chan struct{})
		)
		h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
			if block.Load() && m.UUID == "k1" && string(m.Payload) == "bad" {
				blocked.Add(1)
				started <- struct{}{}
				<-release
				return nil, errTransient // this round fails
			}
			return l.handle(m)
		})
		ctx := context.Background()
		deliver(t, h, raw("k1", "k", "bad"))
		deliver(t, h, raw("k2", "k", "k2-v1"))
		require.EqualValues(t, 1, l.refused.Load(), "k1 was refused once")
		dls, err := b.dlq.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		require.Len(t, dls, 1)

		block.Store(true)
		require.NoError(t, b.store.Retry(ctx, "billing", "k"))
		done := make(chan error, 1)
		go func() { _, err := p.RetryDue(ctx); done <- err }()
		<-started // the round runs k1's old payload now

		edited := func() *message.Message {
			m := raw("k1", "k", "k1-fixed")
			m.Metadata.Set(metadata.DeadLetterReplayOf, strconv.FormatInt(dls[0].ID, 10))
			return m
		}
		_, err = h(edited())
		require.Error(t, err, "the replay of a head being retried must be nacked, not acked as replaced")
		require.ErrorContains(t, err, "its head is being retried now")
		require.ErrorContains(t, err, `"k"`, "the error names the key")
		parked, err := b.store.Messages(ctx, "billing", "k")
		require.NoError(t, err)
		require.Len(t, parked, 2)
		require.Equal(t, "bad", string(parked[0].Payload), "the nacked replay wrote nothing")

		close(release)
		require.NoError(t, <-done)
		require.Positive(t, blocked.Load())
		require.Empty(t, l.list(), "the round failed: nothing applied")
		require.Len(t, b.keys(t), 1, "key k still parked after the failed round")

		deliver(t, h, edited()) // the broker's redelivery: now it replaces
		b.drain(t, p, nil)
		require.Equal(t, []string{"k1=k1-fixed", "k2=k2-v1"}, l.list(), "the edited payload applied once, in its key's place")
	})
}
