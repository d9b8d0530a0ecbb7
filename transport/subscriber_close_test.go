package transport_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// TestPubSubSubscriberClosedMidReadLosesNothing is the scenario of
// Watermill's TestContinueAfterSubscribeClose on Pub/Sub, with the wait
// its harness lacks. A subscriber closed mid-read leaves the messages the
// server had already sent to its stream leased to it, and Pub/Sub
// redelivers them only when that lease ends (MaxExtension, 10s here):
// upstream's test reads each batch with a 15s window per message and gives
// up after 20 batches, so on a loaded machine some of those messages came
// back after it stopped looking ("received: 4971, sent: 5000"; read until
// everything came, they all came, 10s after the close). Here subscribers
// are opened, read from and closed mid-stream ten times; every message
// must then arrive, within a few leases of the last close, and nothing
// that was not published.
func TestPubSubSubscriberClosedMidReadLosesNothing(t *testing.T) {
	t.Parallel()
	cfg := transporttest.Config(t, transport.GoogleCloud)
	const (
		total    = 3000
		cycles   = 10
		perCycle = 400
	)
	open := func() (*transport.Transport, message.Subscriber) {
		tr, err := transport.Open(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tr.Close() })
		sub, err := tr.Subscriber("")
		require.NoError(t, err)
		return tr, sub
	}
	topic := "close_mid_read_" + watermill.NewShortUUID()
	tr, first := open()
	require.NoError(t, first.(message.SubscribeInitializer).SubscribeInitialize(topic))

	sent := map[string]bool{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	next := make(chan struct{})
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range next {
				m := message.NewMessage(watermill.NewUUID(), []byte("x"))
				mu.Lock()
				sent[m.UUID] = true
				mu.Unlock()
				if err := tr.Publisher().Publish(topic, m); err != nil {
					t.Errorf("publishing %s: %v", m.UUID, err)
				}
			}
		}()
	}
	for range total {
		next <- struct{}{}
	}
	close(next)
	wg.Wait()
	require.Len(t, sent, total)

	got := map[string]bool{}
	receive := func(m *message.Message) {
		require.True(t, sent[m.UUID], "received %s, which was not published", m.UUID)
		got[m.UUID] = true
		m.Ack()
	}
	for cycle := range cycles {
		_, sub := open()
		msgs, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		read := 0
	batch:
		for read < perCycle {
			select {
			case m := <-msgs:
				receive(m)
				read++
			case <-time.After(3 * time.Second): // the rest is leased to a closed subscriber
				break batch
			}
		}
		require.NoError(t, sub.Close())
		if cycle == 0 {
			// The fault: the subscriber went away with messages unread.
			require.Less(t, len(got), total, "the first subscriber read everything before it closed")
		}
	}

	msgs, err := first.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	lastClose := time.Now()
	// Every lease of a closed subscriber has ended after MaxExtension; a
	// few of them leave room for a slow emulator.
	deadline := time.After(4 * cfg.GoogleCloud.MaxExtension)
	for len(got) < total {
		select {
		case m := <-msgs:
			receive(m)
		case <-deadline:
			t.Fatalf("%d of %d messages received, %s after the last subscriber closed", len(got), total, time.Since(lastClose).Round(time.Second))
		}
	}
	t.Logf("all %d messages received across %d subscribers closed mid-read, the last %s after the last close", total, cycles, time.Since(lastClose).Round(time.Millisecond))
}
