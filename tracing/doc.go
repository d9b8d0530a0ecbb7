// Package tracing carries OpenTelemetry trace context through millwright:
// from the request that writes an event, through the outbox relay and the
// broker, to the consumer and the saga steps it drives, so one order's
// whole flow is one trace.
//
// The trace context travels as W3C traceparent/tracestate in message
// metadata (metadata.TraceParent, metadata.TraceState), which every
// transport carries as a header or attribute. Spans:
//
//	outbox write <topic>    StartWrite, in the writer's transaction (producer)
//	relay publish <topic>   StartRelayPublish, around the relay's publish (producer)
//	publish <topic>         Publisher, a decorator for direct publishes (producer)
//	handle <topic>          Middleware, around each handler (consumer)
//	saga step <saga>/<step> StartSagaStep, around each saga step (internal)
//
// Usage:
//
//	// writer, inside the request's span:
//	_, span := tracing.StartWrite(ctx, "orders", msg) // stores traceparent in msg
//	... insert msg into the outbox in tx, commit ...
//	span.End()
//
//	// relay, per event read back from the outbox:
//	_, span := tracing.StartRelayPublish(topic, msg)
//	err := pub.Publish(topic, msg)
//	tracing.EndSpan(span, err)
//
//	// consumers:
//	router.AddMiddleware(tracing.Middleware(tracing.Config{}))
//
// Guarantees: nothing is written when there is no valid span (a traceparent
// the message already has is kept); spans never change payloads or the
// other metadata; Middleware restores msg.Context() after the handler
// (Watermill #467) and records the handler's error on the span. The zero
// Config uses the global TracerProvider, so with none installed every span
// is a no-op and costs next to nothing.
//
// LogFields and TraceID give loggers the message id, event id, topic and
// trace id to put on every line about a message.
package tracing
