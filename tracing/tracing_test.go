package tracing_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/tracing"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

type bundle struct {
	exp *tracetest.InMemoryExporter
	cfg tracing.Config
}

func setup(t *testing.T) bundle {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return bundle{exp: exp, cfg: tracing.Config{TracerProvider: tp}}
}

// byName indexes the finished spans by name; it fails on duplicates.
func byName(t *testing.T, spans tracetest.SpanStubs) map[string]tracetest.SpanStub {
	m := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		_, dup := m[s.Name]
		require.False(t, dup, "span %q ended twice", s.Name)
		m[s.Name] = s
	}
	return m
}

func requireChild(t *testing.T, parent, child tracetest.SpanStub) {
	t.Helper()
	require.Equal(t, parent.SpanContext.TraceID(), child.SpanContext.TraceID(), "%s and %s are in different traces", parent.Name, child.Name)
	require.Equal(t, parent.SpanContext.SpanID(), child.Parent.SpanID(), "%s is not the parent of %s", parent.Name, child.Name)
}

// TestOneTraceAcrossEachTransport writes an event under a request span
// (outbox write), relays it (relay publish, in a context without the
// request's span, as a relay is), and consumes it through the middleware
// (handle): the four spans form one chain in one trace on every kind.
func TestOneTraceAcrossEachTransport(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			tr := transporttest.Open(t, kind)
			sub, err := tr.Subscriber("tracing")
			require.NoError(t, err)
			topic := "trace_" + watermill.NewShortUUID()
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, []string{topic}, "tracing")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)

			// The request: write the event (the outbox stores metadata).
			reqCtx, req := b.cfg.TracerProvider.Tracer("test").Start(context.Background(), "request")
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
			_, write := b.cfg.StartWrite(reqCtx, topic, msg)
			write.End()
			req.End()
			stored := msg.Metadata.Get(metadata.TraceParent)
			require.NotEmpty(t, stored)

			// The relay: a fresh message from the stored row.
			relayed := message.NewMessage(msg.UUID, msg.Payload)
			for k, v := range msg.Metadata {
				relayed.Metadata.Set(k, v)
			}
			_, relay := b.cfg.StartRelayPublish(topic, relayed)
			err = tr.Publisher().Publish(topic, relayed)
			tracing.EndSpan(relay, err)
			require.NoError(t, err)

			handled := make(chan trace.SpanContext, 1)
			h := tracing.Middleware(b.cfg)(func(m *message.Message) ([]*message.Message, error) {
				handled <- trace.SpanContextFromContext(m.Context())
				return nil, nil
			})
			select {
			case got := <-msgs:
				_, err := h(got)
				require.NoError(t, err)
				got.Ack()
			case <-ctx.Done():
				t.Fatalf("%s: message not consumed", kind)
			}
			inHandler := <-handled

			spans := byName(t, b.exp.GetSpans())
			require.Len(t, spans, 4, "spans: %v", spans)
			reqS, writeS := spans["request"], spans[tracing.SpanWrite+" "+topic]
			relayS, handleS := spans[tracing.SpanRelayPublish+" "+topic], spans[tracing.SpanHandle]
			requireChild(t, reqS, writeS)
			requireChild(t, writeS, relayS)
			requireChild(t, relayS, handleS)
			require.Equal(t, handleS.SpanContext.SpanID(), inHandler.SpanID(), "the handler's context must carry the handle span")
			require.Equal(t, trace.SpanKindConsumer, handleS.SpanKind)
		})
	}
}

// Through a router, the handle span is named after the topic, produced
// messages published through the Publisher decorator join the trace, and a
// failing handler's error is recorded.
func TestRouterPublisherAndMiddleware(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr, err := transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	sub, err := tr.Subscriber("")
	require.NoError(t, err)
	pub := tracing.NewPublisher(tr.Publisher(), b.cfg)

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(tracing.Middleware(b.cfg))
	r.AddHandler("step", "in", sub, "out", pub, func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
	})
	got := make(chan *message.Message, 1)
	r.AddNoPublisherHandler("sink", "out", sub, func(m *message.Message) error {
		got <- m
		return nil
	})
	// Refuses its first delivery (the router nacks it, gochannel sends it
	// again) and accepts the next.
	var refusals atomic.Int32
	r.AddNoPublisherHandler("refuse", "bad", sub, func(m *message.Message) error {
		if refusals.Add(1) == 1 {
			return errors.New("payment declined")
		}
		return nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() { _ = r.Close() })
	select {
	case <-r.Running():
	case err := <-runErr:
		t.Fatalf("router stopped: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("router not running after 10s")
	}

	ctx, root := b.cfg.TracerProvider.Tracer("test").Start(context.Background(), "request")
	in := message.NewMessage(watermill.NewUUID(), nil)
	in.SetContext(ctx)
	require.NoError(t, pub.Publish("in", in))
	root.End()

	var out *message.Message
	select {
	case out = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("the produced message did not reach the sink within 10s")
	}
	require.Equal(t, root.SpanContext().TraceID().String(), tracing.TraceID(out))
	require.Eventually(t, func() bool { return len(b.exp.GetSpans()) == 5 }, 10*time.Second, 10*time.Millisecond)
	spans := byName(t, b.exp.GetSpans())
	requireChild(t, spans["request"], spans["publish in"])
	requireChild(t, spans["publish in"], spans["handle in"])
	requireChild(t, spans["handle in"], spans["publish out"])
	requireChild(t, spans["publish out"], spans["handle out"])
	require.Equal(t, "step", attr(spans["handle in"], "millwright.handler"))

	// The failing handler: its handle span has status Error and the error
	// recorded; the redelivery it accepted ends Unset.
	require.NoError(t, pub.Publish("bad", message.NewMessage(watermill.NewUUID(), nil)))
	var failed, ok, published []tracetest.SpanStub
	require.Eventually(t, func() bool {
		failed, ok, published = nil, nil, nil
		for _, s := range b.exp.GetSpans() {
			switch {
			case s.Name == "publish bad":
				published = append(published, s)
			case s.Name != "handle bad":
			case s.Status.Code == codes.Error:
				failed = append(failed, s)
			default:
				ok = append(ok, s)
			}
		}
		return len(failed) == 1 && len(ok) == 1 && len(published) == 1
	}, 10*time.Second, 10*time.Millisecond, "one failed and one accepted delivery of the refused message")
	require.Equal(t, "payment declined", failed[0].Status.Description)
	require.Equal(t, "refuse", attr(failed[0], "millwright.handler"))
	require.Len(t, failed[0].Events, 1)
	require.Equal(t, "exception", failed[0].Events[0].Name)
	require.Equal(t, codes.Unset, ok[0].Status.Code)
	requireChild(t, published[0], failed[0])
}

func attr(s tracetest.SpanStub, key string) string {
	for _, a := range s.Attributes {
		if string(a.Key) == key {
			return a.Value.Emit()
		}
	}
	return ""
}

func TestHelpers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msg := message.NewMessage("u1", nil)
	require.Equal(t, "", tracing.TraceID(msg))
	tracing.Inject(context.Background(), msg) // no span: nothing written
	require.Empty(t, msg.Metadata.Get(metadata.TraceParent))

	ctx, span := b.cfg.TracerProvider.Tracer("test").Start(context.Background(), "x")
	b.cfg.Inject(ctx, msg)
	require.Equal(t, span.SpanContext().TraceID().String(), tracing.TraceID(msg))
	sctx, step := b.cfg.StartSagaStep(context.Background(), "order", "reserve", msg)
	tracing.EndSpan(step, context.Canceled)
	span.End()
	require.Equal(t, span.SpanContext().TraceID(), trace.SpanContextFromContext(sctx).TraceID())
	stubs := byName(t, b.exp.GetSpans())
	requireChild(t, stubs["x"], stubs[tracing.SpanSagaStep+" order/reserve"])
	require.Equal(t, "Error", stubs[tracing.SpanSagaStep+" order/reserve"].Status.Code.String())

	msg.Metadata.Set(metadata.EventID, "e1")
	f := tracing.LogFields("orders", msg)
	require.Equal(t, watermill.LogFields{"message_uuid": "u1", "event_id": "e1", "topic": "orders", "trace_id": span.SpanContext().TraceID().String()}, f)
	msg.Metadata.Set(metadata.TraceParent, "garbage")
	require.Equal(t, "", tracing.TraceID(msg))
}

// The one-line forms the outbox and relay use: a write span whose context
// the writer stores, and relay spans for a publish call of several events.
func TestWriteSpanAndRelayPublish(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, span := b.cfg.StartWriteSpan(context.Background(), 2)
	msgs := []*message.Message{message.NewMessage("a", nil), message.NewMessage("b", nil)}
	for _, m := range msgs {
		b.cfg.Inject(ctx, m) // what outbox.Add does with ctx's span
	}
	span.End()
	end := b.cfg.RelayPublish("orders", msgs...)
	end(errors.New("broker down"))

	spans := b.exp.GetSpans()
	require.Len(t, spans, 3)
	write := spans[0]
	require.Equal(t, tracing.SpanWrite, write.Name)
	for _, s := range spans[1:] {
		require.Equal(t, tracing.SpanRelayPublish+" orders", s.Name)
		requireChild(t, write, s)
		require.Equal(t, "Error", s.Status.Code.String())
	}
	require.NotEqual(t, spans[1].SpanContext.SpanID(), spans[2].SpanContext.SpanID())
	// Each message now carries its own relay span as parent for consumers.
	require.Contains(t, msgs[0].Metadata.Get(metadata.TraceParent), spans[1].SpanContext.SpanID().String())
}

func TestMiddlewarePanic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msg := message.NewMessage("p", nil)
	orig := msg.Context()
	h := tracing.Middleware(b.cfg)(func(*message.Message) ([]*message.Message, error) { panic("boom") })
	require.PanicsWithValue(t, "boom", func() { _, _ = h(msg) })
	require.Equal(t, orig, msg.Context(), "context restored after a panic")
	spans := b.exp.GetSpans()
	require.Len(t, spans, 1)
	require.Equal(t, "Error", spans[0].Status.Code.String())
}

func TestRecording(t *testing.T) {
	require.False(t, tracing.Recording(), "no test of this package installs an SDK globally")
	require.False(t, tracing.Config{TracerProvider: noop.NewTracerProvider()}.Recording())
	require.False(t, tracing.Config{TracerProvider: trace.NewNoopTracerProvider()}.Recording()) //nolint:staticcheck // the deprecated no-op provider is still in use
	require.True(t, tracing.Config{TracerProvider: sdktrace.NewTracerProvider()}.Recording())
}
