package tracing_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/millwright/millwright/tracing"
)

// An event written under a request span is relayed and handled in the same
// trace.
func Example() {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	cfg := tracing.Config{TracerProvider: tp}

	ctx, req := tp.Tracer("app").Start(context.Background(), "POST /orders")
	msg := message.NewMessage("m-1", []byte(`{"id":"o-1"}`))
	_, write := cfg.StartWrite(ctx, "orders", msg) // stores traceparent
	write.End()
	req.End()

	_, relay := cfg.StartRelayPublish("orders", msg) // later, in the relay
	relay.End()

	handle := tracing.Middleware(cfg)(func(m *message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	_, _ = handle(msg)

	spans := exp.GetSpans()
	for _, s := range spans {
		fmt.Println(s.Name, s.SpanContext.TraceID() == spans[0].SpanContext.TraceID())
	}
	// Output:
	// outbox write orders true
	// POST /orders true
	// relay publish orders true
	// handle true
}
