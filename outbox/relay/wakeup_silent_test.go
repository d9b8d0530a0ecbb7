package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// blackholingPublisher blackholes the relay's wake-up connections (the
// proxy on ListenURL) while it publishes topic's first message: the relay
// is then awake, its wake-up lock given back, its lock connection idle in
// its pool, and its next idle period tries the lock on a connection that
// went silent.
type blackholingPublisher struct {
	message.Publisher
	topic string
	hole  func()
	done  atomic.Bool
}

func (p *blackholingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.done.CompareAndSwap(false, true) {
		p.hole()
	}
	return p.Publisher.Publish(topic, msgs...)
}

// The relay's wake-up connections go silent (a proxy drops every byte, no
// RST, no FIN: a dropped NAT entry) while it is busy: its next try of the
// wake-up lock is bounded, so it keeps relaying (at its poll) instead of
// waiting on the dead connection until TCP gives up (forever through the
// proxy, about 15 minutes of retransmissions on a real network).
func TestRelay_SilentWakeupConnectionDoesNotStallTheRelay(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		got := b.collect(t, "silent")
		p, through := pgProxy(t, b.schema.URL)
		pub := &blackholingPublisher{Publisher: b.pubsub, topic: "silent", hole: p.Blackhole}
		startRelayOn(t, b.handle, pub, Config{ListenURL: through, PollInterval: 100 * time.Millisecond})
		ctx := context.Background()
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "silent", AggregateID: "a", Payload: []byte(`{"n":1}`)}))
		eventually(t, 30*time.Second, func() bool { return len(got.all()) >= 1 }, "the first event was not published")
		require.Positive(t, p.Blackholed(), "no wake-up connection was blackholed: the fault did not happen")

		written := time.Now()
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "silent", AggregateID: "a", Payload: []byte(`{"n":2}`)}))
		eventually(t, 45*time.Second, func() bool { return len(got.all()) >= 2 },
			"the relay stalled on its silent wake-up connection (blackholed %d, dropped bytes %d)", p.Blackholed(), p.DroppedBytes())
		eventually(t, 10*time.Second, func() bool { return p.DroppedBytes() > 0 }, "nothing was dropped: the fault did not happen")
		t.Logf("published %s after its commit (the lock's try gives up after %s)", time.Since(written).Round(time.Millisecond), storage.WakeLockTryTimeout)
	})
}
