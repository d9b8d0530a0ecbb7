package tracing

import (
	"context"
	"fmt"
	"reflect"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/metadata"
)

// InstrumentationName is the name of millwright's tracer.
const InstrumentationName = "github.com/millwright/millwright/tracing"

// Span names. Each is followed by a space and the topic (or saga step).
const (
	SpanWrite        = "outbox write"
	SpanPublish      = "publish"
	SpanRelayPublish = "relay publish"
	SpanHandle       = "handle"
	SpanSagaStep     = "saga step"
)

// Config selects where spans go. The zero value uses the global
// TracerProvider (otel.SetTracerProvider) and W3C trace context.
type Config struct {
	// TracerProvider makes the tracer. Default otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagator writes and reads the trace context in message metadata.
	// Default propagation.TraceContext (the traceparent and tracestate
	// keys, metadata.TraceParent and metadata.TraceState).
	Propagator propagation.TextMapPropagator
}

func (c Config) tracer() trace.Tracer {
	return c.provider().Tracer(InstrumentationName)
}

func (c Config) provider() trace.TracerProvider {
	if c.TracerProvider != nil {
		return c.TracerProvider
	}
	return otel.GetTracerProvider()
}

// Recording reports whether spans started with the provider can be
// recorded: false when no OpenTelemetry SDK is installed (the global
// provider's default, or a no-op provider), where a span does nothing and
// keeps its parent's context, so code that builds a message only to start
// its span may skip it. Cheap: call it per batch (an SDK installed later
// is seen). OpenTelemetry's eBPF auto-instrumentation, which records
// through the global default provider, is not seen.
func Recording() bool { return Config{}.Recording() }

// Recording is the package-level Recording with c's provider.
func (c Config) Recording() bool {
	tp := c.provider()
	if _, ok := tp.(noop.TracerProvider); ok {
		return false
	}
	// The global default (before otel.SetTracerProvider) and the
	// deprecated trace.NewNoopTracerProvider have unexported types.
	switch reflect.TypeOf(tp).String() {
	case "*global.tracerProvider", "trace.noopTracerProvider":
		return false
	}
	return true
}

func (c Config) propagator() propagation.TextMapPropagator {
	if c.Propagator == nil {
		return propagation.TraceContext{}
	}
	return c.Propagator
}

// carrier adapts message metadata to propagation.TextMapCarrier.
type carrier message.Metadata

func (c carrier) Get(k string) string { return c[k] }
func (c carrier) Set(k, v string)     { c[k] = v }
func (c carrier) Keys() []string {
	ks := make([]string, 0, len(c))
	for k := range c {
		ks = append(ks, k)
	}
	return ks
}

// Inject writes the trace context of ctx's span into msg's metadata
// (metadata.TraceParent, metadata.TraceState). It does nothing when ctx has
// no valid span, so a traceparent the message already carries is kept.
func Inject(ctx context.Context, msg *message.Message) {
	Config{}.Inject(ctx, msg)
}

// Inject is the package-level Inject with c's propagator.
func (c Config) Inject(ctx context.Context, msg *message.Message) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	c.propagator().Inject(ctx, carrier(msg.Metadata))
}

// Extract returns ctx carrying the remote span context stored in msg's
// metadata, or ctx unchanged when there is none.
func Extract(ctx context.Context, msg *message.Message) context.Context {
	return Config{}.Extract(ctx, msg)
}

// Extract is the package-level Extract with c's propagator.
func (c Config) Extract(ctx context.Context, msg *message.Message) context.Context {
	return c.propagator().Extract(ctx, carrier(msg.Metadata))
}

// parent is the context a span about msg starts from: msg's own context
// when it carries a span (an in-process caller), else the trace context
// stored in its metadata (a relay or consumer continuing the writer's
// trace).
func (c Config) parent(msg *message.Message) context.Context {
	ctx := msg.Context()
	if trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	return c.Extract(ctx, msg)
}

func messageAttrs(topic string, msg *message.Message, op string) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		attribute.String("messaging.operation.name", op),
		attribute.String("messaging.message.id", msg.UUID),
	}
	if topic != "" {
		attrs = append(attrs, attribute.String("messaging.destination.name", topic))
	}
	if id := msg.Metadata.Get(metadata.EventID); id != "" {
		attrs = append(attrs, attribute.String("cloudevents.event_id", id))
	}
	if typ := msg.Metadata.Get(metadata.EventType); typ != "" {
		attrs = append(attrs, attribute.String("cloudevents.event_type", typ))
	}
	return attrs
}

func spanName(base, topic string) string {
	if topic == "" {
		return base
	}
	return base + " " + topic
}

// StartWrite starts the span of writing an event (the outbox insert) as a
// child of ctx's span and stores the new span's context in msg's metadata,
// so relay and consumers continue the trace. End the span after the
// transaction commits.
func StartWrite(ctx context.Context, topic string, msg *message.Message) (context.Context, trace.Span) {
	return Config{}.StartWrite(ctx, topic, msg)
}

// StartWrite is the package-level StartWrite with c's provider.
func (c Config) StartWrite(ctx context.Context, topic string, msg *message.Message) (context.Context, trace.Span) {
	ctx, span := c.tracer().Start(ctx, spanName(SpanWrite, topic),
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(messageAttrs(topic, msg, "create")...))
	c.Inject(ctx, msg)
	return ctx, span
}

// StartWriteSpan starts the "outbox write" span for a write of n events
// whose trace context is taken from ctx by the writer itself (outbox.Add
// stores the traceparent of the span in ctx): call it first in the write
// and end the span when the write returns.
//
//	ctx, span := tracing.StartWriteSpan(ctx, len(events)); defer span.End()
func StartWriteSpan(ctx context.Context, n int) (context.Context, trace.Span) {
	return Config{}.StartWriteSpan(ctx, n)
}

// StartWriteSpan is the package-level StartWriteSpan with c's provider.
func (c Config) StartWriteSpan(ctx context.Context, n int) (context.Context, trace.Span) {
	return c.tracer().Start(ctx, SpanWrite, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.operation.name", "create"), attribute.Int("messaging.batch.message_count", n)))
}

// RelayPublish starts a "relay publish <topic>" span per message (see
// StartRelayPublish) before one publish call of several messages, and
// returns the function that ends them all with the call's error:
//
//	end := tracing.RelayPublish(topic, msgs...); err := pub.Publish(topic, msgs...); end(err)
func RelayPublish(topic string, msgs ...*message.Message) (end func(error)) {
	return Config{}.RelayPublish(topic, msgs...)
}

// RelayPublish is the package-level RelayPublish with c's provider.
func (c Config) RelayPublish(topic string, msgs ...*message.Message) (end func(error)) {
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		_, spans[i] = c.StartRelayPublish(topic, m)
	}
	return func(err error) {
		for _, s := range spans {
			EndSpan(s, err)
		}
	}
}

// StartRelayPublish starts the span of the outbox relay publishing msg: its
// parent is the trace context stored with the event (metadata.TraceParent),
// so the relay's work joins the writer's trace although it runs in another
// goroutine or process. The span's context replaces the stored one, so the
// consumer's span becomes its child. End the span after the broker
// acknowledged (span.End(); record a failure with End(err) via EndSpan).
func StartRelayPublish(topic string, msg *message.Message) (context.Context, trace.Span) {
	return Config{}.StartRelayPublish(topic, msg)
}

// StartRelayPublish is the package-level StartRelayPublish with c's provider.
func (c Config) StartRelayPublish(topic string, msg *message.Message) (context.Context, trace.Span) {
	ctx, span := c.tracer().Start(c.parent(msg), spanName(SpanRelayPublish, topic),
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(messageAttrs(topic, msg, "publish")...))
	c.Inject(ctx, msg)
	return ctx, span
}

// StartSagaStep starts the span of one saga step handling msg (the event
// or reply that triggered it), a child of the trace msg carries. Commands
// the step sends should be injected with the returned context (Inject or
// the Publisher decorator with msg.SetContext).
func StartSagaStep(ctx context.Context, saga, step string, msg *message.Message) (context.Context, trace.Span) {
	return Config{}.StartSagaStep(ctx, saga, step, msg)
}

// StartSagaStep is the package-level StartSagaStep with c's provider.
func (c Config) StartSagaStep(ctx context.Context, saga, step string, msg *message.Message) (context.Context, trace.Span) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = c.Extract(ctx, msg)
	}
	attrs := append(messageAttrs("", msg, "process"), attribute.String("millwright.saga", saga), attribute.String("millwright.saga.step", step))
	return c.tracer().Start(ctx, spanName(SpanSagaStep, saga+"/"+step), trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
}

// EndSpan records err on span (status Error) when it is not nil, then ends
// the span.
func EndSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// Publisher decorates a publisher: each message gets a "publish <topic>"
// producer span, a child of msg.Context()'s span or else of the trace
// context the message already carries, and the span's context is injected
// into the message before it is sent.
type Publisher struct {
	pub message.Publisher
	cfg Config
}

// NewPublisher wraps pub. It is safe for concurrent use when pub is.
func NewPublisher(pub message.Publisher, cfg Config) *Publisher {
	return &Publisher{pub: pub, cfg: cfg}
}

// Publish implements message.Publisher. Messages are published in one call
// to the wrapped publisher, so batching and ordering are unchanged.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	spans := make([]trace.Span, len(msgs))
	for i, msg := range msgs {
		ctx, span := p.cfg.tracer().Start(p.cfg.parent(msg), spanName(SpanPublish, topic),
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(messageAttrs(topic, msg, "publish")...))
		p.cfg.Inject(ctx, msg)
		spans[i] = span
	}
	err := p.pub.Publish(topic, msgs...)
	for _, s := range spans {
		EndSpan(s, err)
	}
	return err
}

// Close closes the wrapped publisher.
func (p *Publisher) Close() error { return p.pub.Close() }

// Middleware returns the consumer middleware: it starts a "handle <topic>"
// consumer span, a child of the trace context in the message's metadata,
// runs the handler with msg.Context() carrying the span (restored
// afterwards, Watermill #467), records the handler's error, and gives
// messages the handler produced the span's context, so a Publisher
// decorator (or the router's publisher wrapped in one) continues the trace.
func Middleware(cfg Config) func(message.HandlerFunc) message.HandlerFunc {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			orig := msg.Context()
			topic := message.SubscribeTopicFromCtx(orig)
			attrs := messageAttrs(topic, msg, "process")
			if hn := message.HandlerNameFromCtx(orig); hn != "" {
				attrs = append(attrs, attribute.String("millwright.handler", hn))
			}
			ctx, span := cfg.tracer().Start(cfg.Extract(orig, msg), spanName(SpanHandle, topic),
				trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
			msg.SetContext(ctx)
			defer func() {
				if r := recover(); r != nil { // end the span, restore, re-panic
					msg.SetContext(orig)
					EndSpan(span, fmt.Errorf("panic: %v", r))
					panic(r)
				}
			}()
			produced, err := h(msg)
			msg.SetContext(orig)
			for _, m := range produced {
				if !trace.SpanContextFromContext(m.Context()).IsValid() {
					m.SetContext(ctx)
				}
			}
			EndSpan(span, err)
			return produced, err
		}
	}
}

// TraceID returns the trace id in msg's traceparent, or "" when it has
// none or it is malformed. Loggers add it to every line about a message.
func TraceID(msg *message.Message) string { return logfields.Trace(msg) }

// Log field names used by LogFields.
const (
	LogFieldMessageID = logfields.MessageID
	LogFieldEventID   = logfields.EventID
	LogFieldTopic     = logfields.Topic
	LogFieldTraceID   = logfields.TraceID
)

// LogFields returns the fields every log line about msg should carry:
// message id, event id, topic and trace id (those that are known).
func LogFields(topic string, msg *message.Message) watermill.LogFields {
	return logfields.Of(topic, msg)
}
