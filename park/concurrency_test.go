package park_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
)

// Consumers handling different keys concurrently (a key-parallel consumer,
// or several partitions) share one Parker while its retrier runs: every
// key's messages are applied in their order, each once, whatever failed.
func TestKeysInParallelKeepEachKeysOrder(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{Concurrency: 4, PollInterval: 10 * time.Millisecond})
		h := chain(t, p, "billing", a.handle)
		const workers, keysPer, perKey = 6, 4, 8
		rng := rand.New(rand.NewPCG(1, uint64(time.Now().UnixNano())))
		var parkedMsgs int
		for w := range workers {
			for k := range keysPer {
				for j := range perKey {
					u := fmt.Sprintf("w%dk%d-%02d", w, k, j)
					switch n := rng.IntN(10); {
					case n < 1:
						a.failTimes[u] = 3 // parked, heals in its first round
						parkedMsgs++
					case n < 2:
						a.failTimes[u] = 5 // parked, one failed round
						parkedMsgs++
					case n < 3:
						a.failTimes[u] = 1 // heals in place
					}
				}
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range perKey {
					for k := range keysPer {
						m := msg(fmt.Sprintf("w%dk%d-%02d", w, k, j), fmt.Sprintf("w%dk%d", w, k))
						if _, err := h(m); err != nil {
							t.Errorf("message %s nacked: %v", m.UUID, err)
						}
					}
				}
			}()
		}
		wg.Wait()
		total := workers * keysPer * perKey
		poll.Until(t, 60*time.Second, func() bool { return len(a.appliedList()) == total }, "all %d applied", total)
		for w := range workers {
			for k := range keysPer {
				key := fmt.Sprintf("w%dk%d-", w, k)
				got := a.order(isKey(key))
				require.True(t, sort.StringsAreSorted(got), "key %s applied out of order: %v", key, got)
				require.Len(t, got, perKey)
			}
		}
		poll.Until(t, 30*time.Second, func() bool { return len(b.keys(t)) == 0 }, "keys released")
		require.NoError(t, p.Close())
		require.NoError(t, <-done)
		t.Logf("%d of %d messages failed past their in-place retries; %d parked behind", parkedMsgs, total, p.Stats().ParkedBehind)
	})
}

// A retrier that stops (dies, or stalls) past its lease loses the key to another instance,
// which finishes it; the stalled one's late outcome writes nothing.
func TestLeaseTakeover(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setup(t, driver)
		a := newApp()
		stalled, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		first := b.parker(t, park.Config{Lease: time.Second})
		h1 := chain(t, first, "billing", func(m *message.Message) ([]*message.Message, error) {
			if _, retried := park.Retried(m.Context()); retried {
				once.Do(func() { close(stalled) })
				<-release
			}
			return a.handle(m)
		})
		a.fail("l1")
		deliver(t, h1, msg("l1", "l"))
		deliver(t, h1, msg("l2", "l"))
		a.heal("l1")
		b.waitDue(t, "l")
		firstDone := make(chan error, 1)
		ctx1, stop1 := context.WithCancel(context.Background())
		go func() {
			_, err := first.RetryDue(ctx1)
			firstDone <- err
		}()
		<-stalled
		// The first retrier is gone (its loop stopped: a live one would
		// keep extending its claim while the round runs), its handler
		// stuck.
		stop1()

		second := b.parker(t, park.Config{Lease: time.Second})
		chain(t, second, "billing", a.handle)
		b.drain(t, second, nil) // claims l once the first's lease has passed
		require.Equal(t, []string{"l1", "l2"}, a.order(isKey("l")))
		close(release)
		require.NoError(t, <-firstDone, "the stale claim's outcome is dropped, not an error")
		require.Empty(t, b.keys(t))
		require.Equal(t, []string{"l1", "l2"}, a.order(isKey("l")))
	})
}

// Run gives each key its own slot: a round that hangs does not hold the
// other parked keys' rounds.
func TestSlowRoundDoesNotHoldOtherKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, pgtest.DriverPgx)
	a := newApp()
	hanging, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	p := b.parker(t, park.Config{Concurrency: 2, PollInterval: 10 * time.Millisecond, Retry: patient})
	h := chain(t, p, "billing", func(m *message.Message) ([]*message.Message, error) {
		if _, retried := park.Retried(m.Context()); retried && m.UUID == "s1" {
			once.Do(func() { close(hanging) })
			<-release
		}
		return a.handle(m)
	})
	a.fail("s1", "f1")
	deliver(t, h, msg("s1", "s"))
	a.heal("s1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	<-hanging
	deliver(t, h, msg("f1", "f")) // parked after s1's round started
	deliver(t, h, msg("f2", "f"))
	a.heal("f1")
	poll.Until(t, 20*time.Second, func() bool { return len(a.order(isKey("f"))) == 2 }, "key f retried while s1's round hangs")
	require.Empty(t, a.order(isKey("s")))
	close(release)
	poll.Until(t, 20*time.Second, func() bool { return len(b.keys(t)) == 0 }, "s released")
	require.Equal(t, []string{"f1", "f2", "s1"}, a.appliedList())
	require.NoError(t, p.Close())
	require.NoError(t, <-done)
}
