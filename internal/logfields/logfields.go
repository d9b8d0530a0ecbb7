// Package logfields builds the fields every log line about a message
// carries (message id, event id, topic, trace id) without importing
// OpenTelemetry: the trace id is read from the W3C traceparent in the
// message's metadata. tracing.LogFields is this function; packages that
// log but do not trace (retry, idempotency, dlq) use it directly.
package logfields

import (
	"encoding/hex"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
)

// Field names.
const (
	MessageID = "message_uuid"
	EventID   = "event_id"
	Topic     = "topic"
	TraceID   = "trace_id"
)

// Of returns the fields every log line about msg should carry: message id,
// event id, topic (topic, else the subscribe topic of msg's context) and
// trace id, those that are known.
func Of(topic string, msg *message.Message) watermill.LogFields {
	f := watermill.LogFields{MessageID: msg.UUID}
	if id := msg.Metadata.Get(metadata.EventID); id != "" {
		f[EventID] = id
	}
	if topic == "" {
		topic = message.SubscribeTopicFromCtx(msg.Context())
	}
	if topic != "" {
		f[Topic] = topic
	}
	if tid := Trace(msg); tid != "" {
		f[TraceID] = tid
	}
	return f
}

// Trace returns the trace id in msg's traceparent
// (version-traceid-spanid-flags), or "" when it has none, it is malformed
// or the id is all zeros (invalid in W3C trace context).
func Trace(msg *message.Message) string {
	parts := strings.Split(msg.Metadata.Get(metadata.TraceParent), "-")
	if len(parts) < 4 || len(parts[1]) != 32 {
		return ""
	}
	id := parts[1]
	if _, err := hex.DecodeString(id); err != nil || id == "00000000000000000000000000000000" {
		return ""
	}
	return id
}
