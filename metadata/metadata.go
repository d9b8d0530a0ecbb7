package metadata

const (
	// EventID is the CloudEvents id of an event: unique per event, set by the
	// outbox when the event is written and kept across every redelivery and
	// relay retry. Idempotent consumers key on it.
	EventID = "ce_id"
	// EventSource is the CloudEvents source (the producing service).
	EventSource = "ce_source"
	// EventType is the CloudEvents type, versioned ("order.created.v1").
	EventType = "ce_type"
	// EventSpecVersion is the CloudEvents specversion ("1.0").
	EventSpecVersion = "ce_specversion"
	// EventTime is the CloudEvents time (RFC 3339) the event was written.
	EventTime = "ce_time"
	// EventSubject is the CloudEvents subject: the aggregate id.
	EventSubject = "ce_subject"
	// EventDataContentType is the CloudEvents datacontenttype of the payload.
	EventDataContentType = "ce_datacontenttype"

	// OrderingKey groups messages that must stay in order. Transports map it
	// to the broker's ordering feature: the Kafka message key (hash
	// partitioner) and the Pub/Sub ordering key. The outbox sets it to the
	// aggregate type and id.
	OrderingKey = "ordering_key"

	// AggregateType and AggregateID name the aggregate an event belongs to.
	AggregateType = "aggregate_type"
	AggregateID   = "aggregate_id"

	// TraceParent carries the W3C trace context of the request that caused
	// the message.
	TraceParent = "traceparent"
	// TraceState carries the W3C tracestate, when there is one.
	TraceState = "tracestate"
)
