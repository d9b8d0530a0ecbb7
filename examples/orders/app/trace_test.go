package app_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/tracing"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

var (
	traceOnce sync.Once
	spans     *tracetest.InMemoryExporter
)

// exporter installs, once per test binary, a global tracer provider that
// records every span in memory. Other tests' spans land there too; each
// test looks only at its own trace.
func exporter() *tracetest.InMemoryExporter {
	traceOnce.Do(func() {
		spans = tracetest.NewInMemoryExporter()
		otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans)))
		otel.SetTextMapPropagator(propagation.TraceContext{})
	})
	return spans
}

// TestOneOrderIsOneTrace places one order under a request span and checks,
// on every transport kind, that the whole flow (outbox write, relay
// publish, each handler, each saga step) belongs to that one trace.
func TestOneOrderIsOneTrace(t *testing.T) {
	t.Parallel()
	exp := exporter()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			schema := pgtest.New(t, app.AllMigrations()...)
			schema.DB.SetMaxOpenConns(8)
			tr := transporttest.Open(t, kind)
			prefix := "tr" + string(kind[0]) + randHex(4) + "."
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, app.NewTopics(prefix).All(), app.Groups...)
			}
			ctx := context.Background()
			a, err := app.New(app.Config{DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, TopicPrefix: prefix, SagaPollInterval: 100 * time.Millisecond})
			require.NoError(t, err)
			require.NoError(t, a.Seed(ctx, map[string]int64{"book": 10}))
			startServices(t, ctx, a)

			reqCtx, req := otel.Tracer("test").Start(ctx, "POST /orders")
			traceID := req.SpanContext().TraceID()
			_, err = a.PlaceOrder(reqCtx, app.Order{ID: "traced-" + string(kind), SKU: "book", Qty: 1, AmountCents: 500})
			require.NoError(t, err)
			req.End()

			wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			defer cancel()
			s, err := a.WaitSettled(wctx, "traced-%", 0)
			require.NoError(t, err, "summary %s", s)
			require.Equal(t, 1, s.Completed, "summary %s", s)

			// Spans end as handlers return; the last reply's handler may
			// still be finishing when the order reads as settled.
			var names map[string]int
			deadline := time.Now().Add(30 * time.Second)
			for {
				names = map[string]int{}
				for _, sp := range exp.GetSpans() {
					if sp.SpanContext.TraceID() == traceID {
						names[spanKind(sp)]++
					}
				}
				if names[tracing.SpanSagaStep] >= 3 || time.Now().After(deadline) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			require.GreaterOrEqual(t, names[tracing.SpanWrite], 4, "outbox writes in the trace: %v", names)
			require.GreaterOrEqual(t, names[tracing.SpanRelayPublish], 4, "relay publishes in the trace: %v", names)
			require.GreaterOrEqual(t, names[tracing.SpanHandle], 4, "handlers in the trace: %v", names)
			require.GreaterOrEqual(t, names[tracing.SpanSagaStep], 3, "saga steps in the trace (reserve, charge, ship): %v", names)
		})
	}
}

// spanKind maps a span to the tracing package's span name it starts with.
func spanKind(sp tracetest.SpanStub) string {
	for _, n := range []string{tracing.SpanWrite, tracing.SpanRelayPublish, tracing.SpanHandle, tracing.SpanSagaStep, tracing.SpanPublish} {
		if len(sp.Name) >= len(n) && sp.Name[:len(n)] == n {
			return n
		}
	}
	return sp.Name
}
