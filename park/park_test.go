package park_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
)

func isKey(k string) func(string) bool { return func(u string) bool { return strings.HasPrefix(u, k) } }

// A key whose first message fails is parked with its later messages, in
// order, while another key's messages complete; once healed, the retrier
// applies the parked key's messages in their order.
func TestParkedKeyKeepsOrderAndDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{})
		h := chain(t, p, "billing", a.handle)

		a.fail("a1")
		deliver(t, h, msg("a1", "a"))
		deliver(t, h, msg("b1", "b"))
		deliver(t, h, msg("a2", "a"))
		deliver(t, h, msg("a3", "a"))
		deliver(t, h, msg("b2", "b"))
		require.Equal(t, []string{"b1", "b2"}, a.appliedList(), "key b completes while key a is parked")
		require.Equal(t, 2, a.callsOf("a1"), "a1 ran its two in-place attempts before parking")
		require.Zero(t, a.callsOf("a2"), "a2 was parked behind a1 without running")
		ks := b.keys(t)
		require.Len(t, ks, 1)
		require.Equal(t, "a", ks[0].Key)
		require.EqualValues(t, 3, ks[0].Messages)
		require.Equal(t, 2, ks[0].Attempts)
		require.Contains(t, ks[0].LastError, "database unavailable")
		st := p.Stats()
		require.EqualValues(t, 1, st.ParkedFailed)
		require.EqualValues(t, 2, st.ParkedBehind)

		// Still failing: the retrier reschedules a1 and runs nothing else.
		b.drain(t, p, func() bool { return p.Stats().RetryFailed >= 2 })
		require.Equal(t, []string{"b1", "b2"}, a.appliedList())

		a.heal("a1")
		b.drain(t, p, nil)
		require.Equal(t, []string{"a1", "a2", "a3"}, a.order(isKey("a")))
		// A later message of a released key runs at once.
		deliver(t, h, msg("a4", "a"))
		require.Equal(t, []string{"a1", "a2", "a3", "a4"}, a.order(isKey("a")))
	})
}

// A key parked by one instance is retried by another (a restart, or a
// rebalance that moved the partition): the parked rows are the state.
func TestParkedKeySurvivesRestartAndMovesToAnotherInstance(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		first := b.parker(t, park.Config{})
		h1 := chain(t, first, "billing", a.handle)
		a.fail("k1")
		deliver(t, h1, msg("k1", "k"))
		deliver(t, h1, msg("k2", "k"))
		require.NoError(t, first.Close()) // the first consumer stops (or loses the partition)

		a.heal("k1")
		second := b.parker(t, park.Config{})
		h2 := chain(t, second, "billing", a.handle)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- second.Run(ctx) }()
		<-second.Running()
		// The partition's new owner gets k3 meanwhile: behind k2, or run
		// once the key is released; never before k2.
		deliver(t, h2, msg("k3", "k"))
		b.drainBy(t, func() bool { return len(a.order(isKey("k"))) == 3 })
		require.Equal(t, []string{"k1", "k2", "k3"}, a.order(isKey("k")))
		require.NoError(t, second.Close())
		require.NoError(t, <-done)
	})
}

// The budget spent, the head goes to the DLQ with its context; Hold keeps
// the key's later messages until the operator acts, Continue goes on.
func TestBudgetSpentDeadLettersHoldOrContinue(t *testing.T) {
	t.Parallel()
	for _, policy := range []park.OnDeadLetter{park.Hold, park.Continue} {
		t.Run(string(policy), func(t *testing.T) {
			t.Parallel()
			pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
				t.Parallel()
				b := setup(t, driver)
				a := newApp()
				cfg := park.Config{OnDeadLetter: policy, ConsumerGroup: "billing-group"}
				cfg.Retry = fast
				cfg.Retry.MaxAttempts = 3
				p := b.parker(t, cfg)
				h := chain(t, p, "billing", a.handle)
				a.fail("p1")
				deliver(t, h, msg("p1", "p"))
				deliver(t, h, msg("p2", "p"))
				b.drain(t, p, func() bool { return p.Stats().DeadLetters == 1 })

				dls, err := b.dlq.List(context.Background(), dlq.Filter{})
				require.NoError(t, err)
				require.Len(t, dls, 1)
				d := dls[0]
				require.Equal(t, "p1", d.MessageUUID)
				require.Equal(t, dlq.ReasonExhausted, d.Reason)
				require.Equal(t, "billing", d.Handler)
				require.Equal(t, "billing-group", d.ConsumerGroup)
				require.Contains(t, d.Error, "database unavailable")
				require.Equal(t, 2+3*2, d.Attempts, "2 in place, then 3 rounds of 2")
				require.Equal(t, "p", d.Metadata["ordering_key"])
				require.True(t, d.LastFailure.After(d.FirstFailure))

				if policy == park.Continue {
					b.drain(t, p, nil)
					require.Equal(t, []string{"p2"}, a.order(isKey("p")))
					return
				}
				ks := b.keys(t)
				require.Len(t, ks, 1)
				require.True(t, ks[0].Held)
				require.Equal(t, d.ID, ks[0].DeadLetterID)
				// Held: rounds claim nothing, p2 does not run, a new message waits.
				_, err = p.RetryDue(context.Background())
				require.NoError(t, err)
				deliver(t, h, msg("p3", "p"))
				require.Empty(t, a.order(isKey("p")))

				// The operator fixes the cause and retries the key: p1, then the rest.
				a.heal("p1")
				require.NoError(t, b.store.Retry(context.Background(), "billing", "p"))
				b.drain(t, p, nil)
				require.Equal(t, []string{"p1", "p2", "p3"}, a.order(isKey("p")))
			})
		})
	}
}

// Release drops a held head (it stays in the DLQ) and goes on with the
// key; a permanent error on first delivery holds the key too.
func TestReleaseAndPermanentOnFirstDelivery(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{})
		h := chain(t, p, "billing", a.handle)
		a.permanent["r1"] = true
		deliver(t, h, msg("r1", "r"))
		require.Equal(t, 1, a.callsOf("r1"), "a permanent error is not retried")
		deliver(t, h, msg("r2", "r"))
		require.Empty(t, a.order(isKey("r")), "the key is held behind its dead letter")
		ks := b.keys(t)
		require.Len(t, ks, 1)
		require.True(t, ks[0].Held)
		dls, err := b.dlq.List(context.Background(), dlq.Filter{})
		require.NoError(t, err)
		require.Len(t, dls, 1)
		require.Equal(t, dlq.ReasonPermanent, dls[0].Reason)

		require.ErrorIs(t, b.store.Release(context.Background(), "billing", "nope", false), park.ErrNotParked)
		require.NoError(t, b.store.Release(context.Background(), "billing", "r", false))
		b.drain(t, p, nil)
		require.Equal(t, []string{"r2"}, a.order(isKey("r")))
		require.Equal(t, 1, a.callsOf("r1"), "released, r1 is not run again (it is in the DLQ)")
	})
}

// The retrier releasing a key races a new message of the key arriving on
// the consumer: whichever wins, the new message is applied after the
// parked ones, exactly once.
func TestReleaseRacesArrival(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{})
		h := chain(t, p, "billing", a.handle)
		const rounds = 40
		var parkedBehind, ranDirect int
		for i := range rounds {
			key := fmt.Sprintf("race%d-", i)
			first, next := key+"1", key+"2"
			a.fail(first)
			deliver(t, h, msg(first, key))
			a.heal(first)
			before := p.Stats().ParkedBehind
			// Let the head become due, then release and arrive at once.
			b.waitDue(t, key)
			var wg sync.WaitGroup
			wg.Add(2)
			start := make(chan struct{})
			go func() {
				defer wg.Done()
				<-start
				_, err := p.RetryDue(context.Background())
				require.NoError(t, err)
			}()
			go func() {
				defer wg.Done()
				<-start
				_, err := h(msg(next, key))
				require.NoError(t, err)
			}()
			close(start)
			wg.Wait()
			if p.Stats().ParkedBehind > before {
				parkedBehind++
			} else {
				ranDirect++
			}
			b.drain(t, p, nil)
			require.Equal(t, []string{first, next}, a.order(isKey(key)), "round %d", i)
		}
		t.Logf("%d arrivals parked behind, %d ran after the release", parkedBehind, ranDirect)
	})
}

// Two handlers wrapped under one name on one Parker: the second is
// refused (its messages nacked with an error naming the handler and the
// fix, its handler never run), the first keeps the name and its parked
// keys, and Run says why it does not start. Before, the second silently
// took the name and the retrier ran the first's parked messages with it.
func TestSecondHandlerWithTakenNameIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, pgtest.DriverPQ)
	first, second := newApp(), newApp()
	p := b.parker(t, park.Config{})
	h1 := chain(t, p, "billing", first.handle)
	h2 := chain(t, p, "billing", second.handle)

	first.fail("a1")
	deliver(t, h1, msg("a1", "a"))
	require.Len(t, b.keys(t), 1, "a1 parked under billing")

	_, err := h2(msg("c1", "c"))
	require.ErrorIs(t, err, park.ErrDuplicateHandler, "the second handler's message is nacked")
	require.ErrorContains(t, err, `two handlers of one Parker are named "billing"`)
	require.ErrorContains(t, err, "give each handler its own name")
	require.Zero(t, second.callsOf("c1"), "the refused handler never runs")

	first.heal("a1")
	b.drain(t, p, nil)
	require.Equal(t, []string{"a1"}, first.appliedList(), "the first handler keeps its parked keys")
	require.Empty(t, second.appliedList())

	err = p.Run(context.Background())
	require.ErrorIs(t, err, park.ErrDuplicateHandler)
	require.ErrorContains(t, err, `"billing"`)
}
