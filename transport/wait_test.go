package transport_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// waitLog counts the failures Open logs while it waits for the broker.
type waitLog struct {
	watermill.NopLogger
	mu       sync.Mutex
	failures []string
	seen     chan struct{} // gets a value at each failure
}

func newWaitLog() *waitLog { return &waitLog{seen: make(chan struct{}, 1000)} }

func (l *waitLog) Error(msg string, err error, f watermill.LogFields) {
	if msg != "Broker unreachable; waiting for it" {
		return
	}
	l.mu.Lock()
	l.failures = append(l.failures, err.Error()+" waiting_for="+f["waiting_for"].(string))
	l.mu.Unlock()
	l.seen <- struct{}{}
}

func (l *waitLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *waitLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.failures)
}

// awaitFailures returns once n failures were logged, or fails the test.
func (l *waitLog) awaitFailures(t *testing.T, n int, open <-chan openResult) {
	t.Helper()
	deadline := time.After(25 * time.Second)
	for l.count() < n {
		select {
		case <-l.seen:
		case r := <-open:
			t.Fatalf("Open returned before %d failures were logged (tr=%v): %v", n, r.tr, r.err)
		case <-deadline:
			t.Fatalf("only %d failures logged in 25s, want %d", l.count(), n)
		}
	}
}

type openResult struct {
	tr  *transport.Transport
	err error
}

// proxiedConfig returns the kind's test configuration with the broker
// reached through a fault proxy that refuses every connection (accepts
// and closes it) until the test ends the outage.
func proxiedConfig(t *testing.T, kind transport.Kind) (transport.Config, *faultproxy.Proxy) {
	t.Helper()
	cfg := transporttest.Config(t, kind)
	if !transporttest.Real(kind) {
		t.Skip("needs the real broker: " + transporttest.Brokers())
	}
	var target string
	switch kind {
	case transport.Kafka:
		target = cfg.Kafka.Brokers[0]
	case transport.AMQP:
		target = hostOf(t, cfg.AMQP.URL)
	case transport.GoogleCloud:
		target = cfg.GoogleCloud.EmulatorHost
	case transport.SQL:
		target = hostOf(t, cfg.SQL.URL)
	case transport.NATS:
		target = hostOf(t, cfg.NATS.URL)
	}
	p, err := faultproxy.New(target)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	p.Outage(time.Hour)
	switch kind {
	case transport.Kafka:
		// Only the bootstrap goes through the proxy: the broker
		// advertises its own address, which the client then uses. That
		// bootstrap is Open's contact, which is what waits.
		cfg.Kafka.Brokers = []string{p.Addr()}
	case transport.AMQP:
		cfg.AMQP.URL, err = p.URL(cfg.AMQP.URL)
		require.NoError(t, err)
	case transport.GoogleCloud:
		cfg.GoogleCloud.EmulatorHost = p.Addr()
	case transport.SQL:
		cfg.SQL.URL, err = p.URL(cfg.SQL.URL)
		require.NoError(t, err)
	case transport.NATS:
		cfg.NATS.URL, err = p.URL(cfg.NATS.URL)
		require.NoError(t, err)
	}
	cfg.Kafka.ConnectTimeout = 5 * time.Second
	cfg.AMQP.ConnectTimeout = 5 * time.Second
	cfg.GoogleCloud.ConnectTimeout = 5 * time.Second
	cfg.SQL.ConnectTimeout = 5 * time.Second
	cfg.NATS.ConnectTimeout = 5 * time.Second
	return cfg, p
}

func hostOf(t *testing.T, raw string) string {
	t.Helper()
	_, rest, ok := strings.Cut(raw, "://")
	require.True(t, ok)
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		rest = rest[at+1:]
	}
	host, _, _ := strings.Cut(rest, "/")
	return host
}

var brokerKinds = []transport.Kind{transport.Kafka, transport.AMQP, transport.GoogleCloud, transport.SQL, transport.NATS}

// TestOpenWaitsForABrokerThatIsDown: Open is called while the broker is
// unreachable (the proxy in front of it refuses every connection). It
// does not fail: it logs each failed attempt with what it waits for and
// tries again; once the test has seen two logged failures it ends the
// outage, and the same Open call returns a transport that publishes and
// receives a message, without a restart.
func TestOpenWaitsForABrokerThatIsDown(t *testing.T) {
	t.Parallel()
	for _, kind := range brokerKinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			cfg, proxy := proxiedConfig(t, kind)
			logs := newWaitLog()
			cfg.Logger = logs
			var onWait sync.Map
			cfg.OnWait = func(err error) { onWait.Store(err.Error(), true) }
			ctx, cancel := context.WithTimeout(context.Background(), 35*time.Second)
			defer cancel()
			open := make(chan openResult, 1)
			go func() {
				tr, err := transport.Open(ctx, cfg)
				open <- openResult{tr, err}
			}()
			logs.awaitFailures(t, 2, open)
			refused := proxy.Refused()
			require.GreaterOrEqual(t, refused, int64(2), "the proxy refused fewer connections than failures were logged")
			proxy.Outage(0) // the broker is back

			var r openResult
			select {
			case r = <-open:
			case <-ctx.Done():
				t.Fatalf("Open did not return within 35s after the broker came back; failures logged: %v", logs.failures)
			}
			require.NoError(t, r.err, "Open must reach the broker once it is back")
			t.Cleanup(func() { _ = r.tr.Close() })
			logs.mu.Lock()
			t.Logf("%s: %d failures logged before the broker came back (proxy refused %d connections); first: %s", kind, len(logs.failures), refused, logs.failures[0])
			require.Contains(t, logs.failures[0], "waiting_for=the "+string(kind)+" broker")
			logs.mu.Unlock()
			n := 0
			onWait.Range(func(any, any) bool { n++; return true })
			require.Positive(t, n, "OnWait was not called")

			roundTrip(t, ctx, r.tr, kind)
		})
	}
}

// roundTrip publishes one message to a new topic and receives it.
func roundTrip(t *testing.T, ctx context.Context, tr *transport.Transport, kind transport.Kind) {
	t.Helper()
	topic := "wait_" + strings.ReplaceAll(watermill.NewShortUUID(), "-", "")
	if kind == transport.AMQP {
		transporttest.DeleteAMQPTopology(t, []string{topic}, "grp")
	}
	sub, err := tr.Subscriber("grp")
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	want := message.NewMessage(watermill.NewUUID(), []byte("after the wait"))
	require.NoError(t, tr.Publisher().Publish(topic, want))
	select {
	case m := <-msgs:
		require.Equal(t, want.UUID, m.UUID)
		m.Ack()
	case <-ctx.Done():
		t.Fatalf("%s: the message published after the wait was not received", kind)
	}
}

// TestOpenWaitEndsWithItsContext: with the broker away for good, Open
// waits until its context is cancelled, then returns an error saying it
// gave up waiting, with the context's error and the last failure.
func TestOpenWaitEndsWithItsContext(t *testing.T) {
	t.Parallel()
	for _, kind := range brokerKinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			cfg, proxy := proxiedConfig(t, kind)
			logs := newWaitLog()
			cfg.Logger = logs
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			open := make(chan openResult, 1)
			go func() {
				tr, err := transport.Open(ctx, cfg)
				open <- openResult{tr, err}
			}()
			logs.awaitFailures(t, 2, open)
			cancel()
			var r openResult
			select {
			case r = <-open:
			case <-time.After(15 * time.Second):
				t.Fatal("Open did not return within 15s of its context's cancellation")
			}
			require.Error(t, r.err)
			t.Log(r.err)
			require.ErrorIs(t, r.err, transport.ErrGaveUpWaiting)
			require.ErrorIs(t, r.err, context.Canceled)
			require.Contains(t, r.err.Error(), "last failure")
			require.Positive(t, proxy.Refused())
		})
	}
}

// TestWaitForBrokerBoundsTheWait: a positive WaitForBroker stops waiting
// after that long; NoWait returns the first failure.
func TestWaitForBrokerBoundsTheWait(t *testing.T) {
	t.Parallel()
	cfg, _ := proxiedConfig(t, transport.AMQP)
	logs := newWaitLog()
	cfg.Logger = logs
	cfg.WaitForBroker = 2 * time.Second
	start := time.Now()
	_, err := transport.Open(context.Background(), cfg)
	require.ErrorIs(t, err, transport.ErrGaveUpWaiting)
	// It tries until the bound, not until a jittered delay would pass it
	// (before, it could give up a whole delay early).
	require.GreaterOrEqual(t, time.Since(start), 2*time.Second, "gave up before WaitForBroker")
	require.Contains(t, err.Error(), "WaitForBroker 2s")
	require.Positive(t, logs.count())

	cfg.WaitForBroker = transport.NoWait
	logs = newWaitLog()
	cfg.Logger = logs
	_, err = transport.Open(context.Background(), cfg)
	require.Error(t, err)
	require.False(t, errors.Is(err, transport.ErrGaveUpWaiting), "%v", err)
	require.Zero(t, logs.count(), "NoWait logged a wait")
}
