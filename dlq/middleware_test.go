package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

const traceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

var fastRetry = retry.Policy{InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxAttempts: 3}

// bundle is a running router with one handler behind the DLQ middleware.
type bundle struct {
	pubsub   *gochannel.GoChannel // the consumed topic
	deadPS   *gochannel.GoChannel // the dead-letter topics, outliving the router
	router   *message.Router
	dead     <-chan *message.Message
	topic    string
	attempts atomic.Int64
}

// setup runs a router whose handler "h" consumes topic "orders" through
// the middleware. dlPub, when not nil, replaces the gochannel as the
// dead-letter publisher.
func setup(t *testing.T, cfg dlq.Config, dlPub message.Publisher, h func(*message.Message) error) *bundle {
	t.Helper()
	b := &bundle{topic: "orders"}
	b.pubsub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	t.Cleanup(func() { _ = b.pubsub.Close() })
	b.deadPS = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	t.Cleanup(func() { _ = b.deadPS.Close() })
	dead, err := b.deadPS.Subscribe(context.Background(), dlq.DefaultTopic(b.topic))
	require.NoError(t, err)
	b.dead = dead
	if dlPub == nil {
		dlPub = b.deadPS
	}
	mw, err := dlq.NewMiddleware(dlPub, cfg)
	require.NoError(t, err)
	b.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	b.router.AddConsumerHandler("h", b.topic, b.pubsub, func(msg *message.Message) error {
		b.attempts.Add(1)
		return h(msg)
	}).AddMiddleware(mw.Middleware)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.router.Run(context.Background())
	}()
	t.Cleanup(func() {
		_ = b.router.Close()
		<-done
	})
	<-b.router.Running()
	return b
}

func (b *bundle) publish(t *testing.T, payload string) *message.Message {
	t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
	msg.Metadata.Set(metadata.TraceParent, traceParent)
	msg.Metadata.Set(metadata.EventID, "evt-"+msg.UUID)
	require.NoError(t, b.pubsub.Publish(b.topic, msg))
	return msg
}

func (b *bundle) nextDead(t *testing.T) *message.Message {
	t.Helper()
	select {
	case m, ok := <-b.dead:
		require.True(t, ok, "dead-letter subscription closed")
		m.Ack()
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no dead letter within 10s")
		return nil
	}
}

func TestPoisonReachesDLQAfterExactlyNAttempts(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	logger := &errorLogger{}
	start := time.Now()
	b := setup(t, dlq.Config{Retry: fastRetry, ConsumerGroup: "billing", Registerer: reg, Logger: logger}, nil, func(*message.Message) error {
		return errors.New("payment service said no")
	})
	orig := b.publish(t, `{"order":1}`)
	dl := b.nextDead(t)

	require.EqualValues(t, 3, b.attempts.Load())
	md := dl.Metadata
	require.Equal(t, orig.UUID, dl.UUID)
	require.Equal(t, `{"order":1}`, string(dl.Payload))
	require.Equal(t, "orders", md.Get(metadata.DeadLetterOriginalTopic))
	require.Equal(t, "orders.dlq", md.Get(metadata.DeadLetterTopic))
	require.Equal(t, "billing", md.Get(metadata.DeadLetterConsumerGroup))
	require.Equal(t, "h", md.Get(metadata.DeadLetterHandler))
	require.Equal(t, dlq.ReasonExhausted, md.Get(metadata.DeadLetterReason))
	require.Equal(t, "payment service said no", md.Get(metadata.DeadLetterError))
	require.Equal(t, "*errors.errorString", md.Get(metadata.DeadLetterErrorType))
	require.Empty(t, md.Get(metadata.DeadLetterStack))
	require.Equal(t, "3", md.Get(metadata.DeadLetterAttempts))
	require.Equal(t, orig.UUID, md.Get(metadata.DeadLetterOriginalMessageID))
	require.Equal(t, traceParent, md.Get(metadata.TraceParent), "trace context kept")
	require.Equal(t, "evt-"+orig.UUID, md.Get(metadata.EventID), "original metadata kept")
	first, err := time.Parse(time.RFC3339Nano, md.Get(metadata.DeadLetterFirstFailure))
	require.NoError(t, err)
	last, err := time.Parse(time.RFC3339Nano, md.Get(metadata.DeadLetterLastFailure))
	require.NoError(t, err)
	require.False(t, first.Before(start))
	require.True(t, last.After(first), "first %s, last %s", first, last)

	// The counter and the log line follow the dead-letter publish, which
	// gochannel delivers before Publish returns.
	eventually(t, "the dead-letter counter", func() bool {
		return len(logger.lines()) > 0
	})
	require.Equal(t, 1.0, counterValue(t, reg, dlq.MetricDeadLetters, "orders", dlq.ReasonExhausted))
	require.Equal(t, 2.0, counterValue(t, reg, retry.MetricRetries, "orders", retry.ReasonError))

	errorLines := logger.lines()
	require.Len(t, errorLines, 1, "one error line per dead letter: %v", errorLines)
	line := errorLines[0]
	require.Equal(t, "Message dead-lettered", line.Msg)
	require.Equal(t, orig.UUID, line.Fields["message_uuid"])
	require.Equal(t, "orders", line.Fields["topic"])
	require.ErrorContains(t, line.Err, "payment service said no")
}

// counterValue reads one series of a counter from reg.
func counterValue(t *testing.T, reg *prometheus.Registry, name, topic, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if (l.GetName() == "topic" && l.GetValue() != topic) || (l.GetName() == "reason" && l.GetValue() != reason) {
					continue series
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("metric %s{topic=%q,reason=%q} not found", name, topic, reason)
	return 0
}

func TestPermanentErrorSkipsRetries(t *testing.T) {
	t.Parallel()
	b := setup(t, dlq.Config{Retry: fastRetry}, nil, func(*message.Message) error {
		return failure.Permanent(fmt.Errorf("order refers to unknown customer: %w", errUnknown))
	})
	b.publish(t, "x")
	dl := b.nextDead(t)
	require.EqualValues(t, 1, b.attempts.Load())
	require.Equal(t, "1", dl.Metadata.Get(metadata.DeadLetterAttempts))
	require.Equal(t, dlq.ReasonPermanent, dl.Metadata.Get(metadata.DeadLetterReason))
	require.Equal(t, "order refers to unknown customer: unknown customer", dl.Metadata.Get(metadata.DeadLetterError))
	require.Equal(t, "*dlq_test.customerError", dl.Metadata.Get(metadata.DeadLetterErrorType), "type seen through fmt.Errorf wrapping")
}

type customerError struct{}

func (customerError) Error() string { return "unknown customer" }

var errUnknown = &customerError{}

func TestMalformedGoesStraightToDLQ(t *testing.T) {
	t.Parallel()
	b := setup(t, dlq.Config{Retry: fastRetry}, nil, func(msg *message.Message) error {
		var v struct{ Order int }
		return dlq.DecodeJSON(msg, &v)
	})
	b.publish(t, `{"order": `)
	dl := b.nextDead(t)
	require.EqualValues(t, 1, b.attempts.Load())
	require.Equal(t, dlq.ReasonMalformed, dl.Metadata.Get(metadata.DeadLetterReason))
	require.Contains(t, dl.Metadata.Get(metadata.DeadLetterError), "malformed message: decoding JSON payload of message "+dl.UUID)
	require.Equal(t, "*json.SyntaxError", dl.Metadata.Get(metadata.DeadLetterErrorType))
}

func explode() { panic("nil map in pricing") }

func TestPanicIsDeadLetteredWithStack(t *testing.T) {
	t.Parallel()
	b := setup(t, dlq.Config{Retry: fastRetry, MaxValueBytes: -1}, nil, func(*message.Message) error {
		explode()
		return nil
	})
	b.publish(t, "x")
	dl := b.nextDead(t)
	require.EqualValues(t, 3, b.attempts.Load())
	require.Equal(t, dlq.ReasonPanic, dl.Metadata.Get(metadata.DeadLetterReason))
	require.Equal(t, "panic: nil map in pricing", dl.Metadata.Get(metadata.DeadLetterError))
	require.Equal(t, "*retry.PanicError", dl.Metadata.Get(metadata.DeadLetterErrorType))
	require.Contains(t, dl.Metadata.Get(metadata.DeadLetterStack), "dlq_test.explode")
}

func TestLongValuesAreTruncated(t *testing.T) {
	t.Parallel()
	long := make([]byte, 5000)
	for i := range long {
		long[i] = 'e'
	}
	b := setup(t, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}}, nil, func(*message.Message) error {
		return errors.New(string(long))
	})
	b.publish(t, "x")
	dl := b.nextDead(t)
	v := dl.Metadata.Get(metadata.DeadLetterError)
	require.Len(t, v, dlq.DefaultMaxValueBytes)
	require.Contains(t, v, "[truncated]")
}

// flakyPublisher fails its first n publishes.
type flakyPublisher struct {
	message.Publisher
	mu       sync.Mutex
	failures int
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	if p.failures > 0 {
		p.failures--
		p.mu.Unlock()
		return errors.New("broker unavailable")
	}
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

func TestDLQPublishFailureNacksTheOriginal(t *testing.T) {
	t.Parallel()
	t.Run("returns the error, so the router nacks", func(t *testing.T) {
		t.Parallel()
		mw, err := dlq.NewMiddleware(&flakyPublisher{failures: 1}, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}})
		require.NoError(t, err)
		_, err = mw.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("handler failed")
		})(message.NewMessage("m1", nil))
		require.ErrorContains(t, err, "broker unavailable")
		require.ErrorContains(t, err, "handler failed")
		require.ErrorContains(t, err, `publishing message m1 to dead-letter topic ".dlq" failed, message nacked`)
	})
	t.Run("the message is redelivered and parked later, not lost", func(t *testing.T) {
		t.Parallel()
		b := setupWithLatePublisher(t, &flakyPublisher{failures: 1})
		b.publish(t, "x")
		dl := b.nextDead(t)
		require.Equal(t, "3", dl.Metadata.Get(metadata.DeadLetterAttempts), "second delivery's attempts")
		require.EqualValues(t, 6, b.attempts.Load(), "two deliveries of three attempts each")
	})
}

func setupWithLatePublisher(t *testing.T, flaky *flakyPublisher) *bundle {
	// The flaky publisher wraps the bundle's own gochannel, which setup
	// creates: wire it through a forwarding publisher.
	fwd := &forward{}
	flaky.Publisher = fwd
	b := setup(t, dlq.Config{Retry: fastRetry}, flaky, func(*message.Message) error { return errors.New("always") })
	fwd.set(b.deadPS)
	return b
}

type forward struct {
	mu sync.Mutex
	p  message.Publisher
}

func (f *forward) set(p message.Publisher) { f.mu.Lock(); f.p = p; f.mu.Unlock() }
func (f *forward) Publish(topic string, msgs ...*message.Message) error {
	f.mu.Lock()
	p := f.p
	f.mu.Unlock()
	return p.Publish(topic, msgs...)
}
func (f *forward) Close() error { return nil }

func TestShutdownDuringBackoffDoesNotDeadLetter(t *testing.T) {
	t.Parallel()
	failed := make(chan struct{}, 1)
	b := setup(t, dlq.Config{Retry: retry.Policy{InitialInterval: time.Hour, MaxInterval: time.Hour, Jitter: retry.JitterNone}}, nil,
		func(*message.Message) error {
			select {
			case failed <- struct{}{}:
			default:
			}
			return errors.New("down")
		})
	b.publish(t, "x")
	select {
	case <-failed:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not run within 10s")
	}
	start := time.Now()
	require.NoError(t, b.router.Close())
	// The backoff is an hour: a minute separates the two on any machine.
	require.Less(t, time.Since(start), time.Minute, "router close waited out the backoff")
	select {
	case dl := <-b.dead:
		t.Fatalf("message dead-lettered on shutdown: %v", dl.Metadata)
	default:
	}
	require.EqualValues(t, 1, b.attempts.Load())
}

func TestSuccessIsAckedAndProducesMessages(t *testing.T) {
	t.Parallel()
	mw, err := dlq.NewMiddleware(&flakyPublisher{failures: 100}, dlq.Config{Retry: fastRetry})
	require.NoError(t, err)
	out := message.NewMessage("out", nil)
	calls := 0
	produced, err := mw.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		if retry.Attempt(msg.Context()) < 2 {
			return nil, errors.New("transient")
		}
		return []*message.Message{out}, nil
	})(message.NewMessage("in", nil))
	require.NoError(t, err)
	require.Equal(t, []*message.Message{out}, produced)
	require.Equal(t, 2, calls, "the first attempt failed and was retried")
}

func TestNewMiddlewareValidates(t *testing.T) {
	t.Parallel()
	_, err := dlq.NewMiddleware(nil, dlq.Config{})
	require.ErrorContains(t, err, "needs a message.Publisher")
	_, err = dlq.NewMiddleware(&flakyPublisher{}, dlq.Config{MaxValueBytes: 10})
	require.ErrorContains(t, err, "MaxValueBytes")
	_, err = dlq.NewMiddleware(&flakyPublisher{}, dlq.Config{Retry: retry.Policy{MaxAttempts: -5}})
	require.ErrorContains(t, err, "MaxAttempts")
	_, err = dlq.NewMiddleware(&flakyPublisher{}, dlq.Config{Retry: retry.Policy{MaxAttempts: -1}})
	require.ErrorContains(t, err, "retried forever")
}

func TestPoisonDoesNotBlockGoChannel(t *testing.T) {
	t.Parallel()
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	dlqtest.TestPoisonDoesNotBlock(t, ps, ps, "poison-"+strconv.Itoa(int(time.Now().UnixNano()%1e6)))
}

// errorLogger keeps the Error-level lines; watermill's CaptureLogger hands
// out its map unlocked, which the race detector rejects.
type errorLogger struct {
	watermill.NopLogger
	mu  sync.Mutex
	got []logLine
}

type logLine struct {
	Msg    string
	Err    error
	Fields watermill.LogFields
}

func (l *errorLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, logLine{msg, err, fields})
}

func (l *errorLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errorLogger) lines() []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]logLine(nil), l.got...)
}

// TestDeadLetterIsNotDeadLetteredAgain: a handler consuming the dead-letter
// topic (a recorder whose database is down) nacks instead of parking the
// dead letter on "orders.dlq.dlq".
func TestDeadLetterIsNotDeadLetteredAgain(t *testing.T) {
	t.Parallel()
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	dlPub := &recordingPublisher{}
	mw, err := dlq.NewMiddleware(dlPub, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	nacked := make(chan struct{})
	var calls atomic.Int64
	router.AddConsumerHandler("recorder", "orders.dlq", ps, func(msg *message.Message) error {
		if calls.Add(1) == 2 {
			close(nacked) // redelivered: the first delivery was nacked
		}
		return errors.New("database down")
	}).AddMiddleware(mw.Middleware)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(context.Background()) }()
	t.Cleanup(func() { _ = router.Close(); <-done })
	<-router.Running()

	dl := message.NewMessage(watermill.NewUUID(), nil)
	dl.Metadata.Set(metadata.DeadLetterTopic, "orders.dlq")
	require.NoError(t, ps.Publish("orders.dlq", dl))
	select {
	case <-nacked:
	case <-time.After(10 * time.Second):
		t.Fatal("dead letter not redelivered")
	}
	require.Empty(t, dlPub.published(), "a dead letter was dead-lettered again")
}

// hungPublisher never answers and ignores its messages' context, as a
// publisher whose broker stopped confirming may; it records the deadline
// the dead letter carried.
type hungPublisher struct {
	entered  chan time.Time // the dead letter's deadline, or zero
	released chan struct{}
}

func (p *hungPublisher) Publish(_ string, msgs ...*message.Message) error {
	d, _ := msgs[0].Context().Deadline()
	p.entered <- d
	<-p.released
	return nil
}
func (p *hungPublisher) Close() error { return nil }

// A dead-letter publish that never returns does not hold the handler
// forever: after Config.PublishTimeout the message is nacked for
// redelivery, with an error that names the bound. Before, the middleware
// waited with no bound (the dead letter's context had no deadline).
func TestDLQPublishThatHangsIsBounded(t *testing.T) {
	t.Parallel()
	hung := &hungPublisher{entered: make(chan time.Time, 1), released: make(chan struct{})}
	t.Cleanup(func() { close(hung.released) })
	mw, err := dlq.NewMiddleware(hung, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}, PublishTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := mw.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("handler failed")
		})(message.NewMessage("m1", nil))
		done <- err
	}()
	select {
	case d := <-hung.entered:
		require.False(t, d.IsZero(), "the dead letter's context carries no deadline")
		require.WithinDuration(t, start.Add(200*time.Millisecond), d, 5*time.Second)
	case <-time.After(10 * time.Second):
		t.Fatal("the dead letter was not published within 10s")
	}
	select {
	case err := <-done:
		require.ErrorContains(t, err, "PublishTimeout")
		require.ErrorContains(t, err, "message nacked for redelivery")
		require.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(15 * time.Second):
		t.Fatal("the middleware still waits for the dead-letter publish 15s after its 200ms bound")
	}
}
