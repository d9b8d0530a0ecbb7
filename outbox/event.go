package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox/internal/eventmeta"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

// Event is one event to publish, written with Add.
type Event struct {
	// Topic the relay publishes the event to. Required.
	Topic string
	// AggregateType and AggregateID name the aggregate the event belongs to.
	// Events of one aggregate are published in order, and the aggregate
	// becomes the message's metadata.OrderingKey ("type/id", or just the id
	// when AggregateType is empty). An empty AggregateID makes the event
	// unordered: it is its own aggregate, keyed by its event id.
	AggregateType string
	AggregateID   string
	// EventType is the CloudEvents type, e.g. "order.created.v1".
	// Default: Topic (CloudEvents requires a type).
	EventType string
	// Payload is the message body. Valid JSON is stored in the JSONB payload
	// column, queryable but normalised by Postgres (key order and whitespace
	// may change, the value does not); anything else, or any payload when
	// RawPayload is set, is stored byte for byte in payload_raw.
	Payload []byte
	// RawPayload keeps a JSON payload byte for byte (signed payloads).
	RawPayload bool
	// Metadata is copied to the published message. Keys set here win over
	// the ones Add fills in, except metadata.EventID, which always equals ID.
	// Keys and values are UTF-8 text without NUL (Add refuses others with
	// ErrInvalidEvent naming the key): put binary data in the payload.
	Metadata map[string]string
	// ID is the CloudEvents id (metadata.EventID) and the Watermill message
	// UUID. Default: a random UUID.
	ID string
	// Source is the CloudEvents source (metadata.EventSource), a
	// URI-reference such as "/orders-service". Default: the Writer's
	// (WriterConfig.Source).
	Source string
}

// DefaultMaxEventBytes is the size limit of a Writer built without
// limits, and of the package-level Add: 1 MiB, Kafka's default (Sarama's
// Producer.MaxMessageBytes), the smallest limit among the transports
// (Pub/Sub takes 10 MB, RabbitMQ 16 MiB by default).
const DefaultMaxEventBytes = transport.KafkaMaxMessageBytes

// ErrInvalidEvent is returned (wrapped) by Add and TxPublisher.Publish for an
// event that cannot be stored; the message names the field to fix.
var ErrInvalidEvent = errors.New("invalid outbox event")

// maxRowsPerInsert bounds the size of one INSERT statement.
const maxRowsPerInsert = 1000

// Add writes events to the outbox in tx, the caller's business
// transaction: they are published if and only if it commits. To write
// events with no business rows beside them, call AddOutsideTx. Several events
// are written with one multi-row INSERT per 1,000 events.
//
// Add fills in the CloudEvents metadata (id, type, source, subject, time,
// specversion, datacontenttype), the aggregate keys, and the W3C traceparent
// of the OpenTelemetry span in ctx when Event.Metadata has none.
//
// tx is postgres.SQLTx(*sql.Tx) or postgres.PgxTx(pgx.Tx). The INSERT is one round
// trip on either driver (database/sql: one simple query with the values
// inlined as quoted literals; pgx: one extended-protocol statement), and
// every error, Add's own checks (ErrInvalidEvent) and the server's (say, a
// schema without the outbox table), is returned by Add itself, on every
// driver and pool.
//
// Add is the default Writer's (see Writer): it checks events against the
// rules every transport kind shares, with Kafka's size limit, and gives
// them the source of $MILLWRIGHT_SERVICE_NAME. A service whose relay
// publishes elsewhere writes through a Writer built from its transport's
// limits.
func Add(ctx context.Context, tx postgres.Tx, events ...Event) error {
	return defaultWriter().Add(ctx, tx, events...)
}

// AddOutsideTx writes events to the outbox in a transaction of its own on
// db: all of them or none. It is for a producer with no business rows to
// commit beside its events (a scheduler, an import); a service that
// changes its own tables in the same unit of work calls Add with that
// transaction instead, or an event may announce a change that never
// committed, or a committed change lose its event. It is the default
// Writer's, as Add.
func AddOutsideTx(ctx context.Context, db postgres.DB, events ...Event) error {
	return defaultWriter().AddOutsideTx(ctx, db, events...)
}

// add writes events through q, 1,000 per INSERT.
func (w *Writer) add(ctx context.Context, q storage.Querier, events []Event) error {
	for len(events) > 0 {
		n := min(len(events), maxRowsPerInsert)
		if err := w.insert(ctx, q, events[:n]); err != nil {
			return err
		}
		events = events[n:]
	}
	return nil
}

func (w *Writer) insert(ctx context.Context, q storage.Querier, events []Event) error {
	rows := make([]storage.EventRow, len(events))
	for i, ev := range events {
		row, err := w.prepare(ctx, ev)
		if err != nil {
			return fmt.Errorf("outbox: event %d (topic %q): %w", i, ev.Topic, err)
		}
		rows[i] = row
	}
	if err := storage.InsertEvents(ctx, q, rows); err != nil {
		return fmt.Errorf("outbox: inserting %d event(s) into millwright_outbox%s: %w", len(events), storage.Hint(err), err)
	}
	return nil
}

// prepare validates ev and returns its row's arguments, in named steps:
// the defaults, the NUL check, the metadata to store, the CloudEvents
// check, the metadata the relay derives (not stored twice), and the size
// check.
func (w *Writer) prepare(ctx context.Context, ev Event) (storage.EventRow, error) {
	if ev.Topic == "" {
		return storage.EventRow{}, fmt.Errorf("%w: Topic is empty: set the topic the relay should publish to", ErrInvalidEvent)
	}
	limits := w.limits
	if err := limits.ValidateTopic(ev.Topic); err != nil {
		return storage.EventRow{}, fmt.Errorf("%w: %w (the relay's transport would refuse it on every attempt)", ErrInvalidEvent, err)
	}
	ev, aggID := withDefaults(ev, w.source)
	if err := checkNUL(ev, aggID); err != nil {
		return storage.EventRow{}, err
	}
	md, isJSON := storedMetadata(ctx, ev)
	if err := validateCloudEvent(ev, md); err != nil {
		return storage.EventRow{}, err
	}
	md = dropDerived(ev, aggID, isJSON, md)
	row := storage.EventRow{EventID: ev.ID, Topic: ev.Topic, AggregateType: ev.AggregateType, AggregateID: aggID, EventType: ev.EventType}
	if isJSON {
		row.Payload, row.IsJSON = ev.Payload, true
	} else {
		row.Payload = ev.Payload
		if row.Payload == nil {
			row.Payload = []byte{}
		}
	}
	if err := checkWire(limits, ev, aggID, isJSON, md); err != nil {
		return storage.EventRow{}, err
	}
	row.Metadata = string(appendMetadataJSON(nil, md))
	return row, nil
}

// withDefaults fills in the ID, Source (with source) and EventType ev
// leaves empty, and returns it with its aggregate id: the event's own id
// when it has no aggregate.
func withDefaults(ev Event, source string) (Event, string) {
	if ev.ID == "" {
		ev.ID = uuid.NewString()
	}
	if ev.Source == "" {
		ev.Source = source
	}
	if ev.EventType == "" {
		// CloudEvents requires a type: the topic names what happened when
		// the writer did not.
		ev.EventType = ev.Topic
	}
	aggID := ev.AggregateID
	if aggID == "" {
		aggID = ev.ID
	}
	return ev, aggID
}

// checkNUL refuses a NUL byte in a text column or in the metadata, which
// Postgres cannot store, and metadata that is not UTF-8 text, which the
// JSONB column would store changed (its bytes replaced with U+FFFD, two
// keys merged into one): the relay would publish other headers.
func checkNUL(ev Event, aggID string) error {
	for _, f := range [...]struct{ name, v string }{{"Topic", ev.Topic}, {"AggregateType", ev.AggregateType}, {"AggregateID", aggID}, {"EventType", ev.EventType}, {"ID", ev.ID}, {"Source", ev.Source}} {
		if strings.IndexByte(f.v, 0) >= 0 {
			return fmt.Errorf("%w: %s contains a NUL byte, which Postgres text cannot store", ErrInvalidEvent, f.name)
		}
	}
	const fix = "metadata (message headers) must be UTF-8 text: put binary data in the payload, or base64 it"
	for k, v := range ev.Metadata {
		if strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("%w: metadata %q contains a NUL byte, which Postgres JSONB cannot store", ErrInvalidEvent, k)
		}
		if !utf8.ValidString(k) {
			return fmt.Errorf("%w: metadata key %q is not valid UTF-8: %s", ErrInvalidEvent, k, fix)
		}
		if !utf8.ValidString(v) {
			return fmt.Errorf("%w: metadata %q: its value is not valid UTF-8: %s", ErrInvalidEvent, k, fix)
		}
	}
	return nil
}

// storedMetadata returns the metadata of ev before dropDerived: the
// source, the trace context of ctx, the content type of a raw JSON
// payload, and ev.Metadata (but its event id: the event_id column is
// authoritative); and whether the payload goes to the JSONB column.
func storedMetadata(ctx context.Context, ev Event) (map[string]string, bool) {
	// The metadata column keeps only what the row's other columns do not
	// say: the relay derives the rest when it reads the row (see
	// derivedMetadata). Every byte stored here is written to the table and
	// the WAL inside the caller's transaction.
	var md map[string]string
	set := func(k, v string) {
		if md == nil {
			md = make(map[string]string, len(ev.Metadata)+3)
		}
		md[k] = v
	}
	set(metadata.EventSource, ev.Source)
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		set(metadata.TraceParent, fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags()))
		if ts := sc.TraceState().String(); ts != "" {
			set(metadata.TraceState, ts)
		}
	}
	// JSONB rejects the \u0000 escape, lone surrogate escapes and numbers
	// beyond numeric: such payloads are kept as bytes.
	isJSON := !ev.RawPayload && json.Valid(ev.Payload) && storage.CheckJSONB(ev.Payload) == nil
	if ev.RawPayload && json.Valid(ev.Payload) {
		// Kept byte for byte, but still JSON: readers need its content type
		// (the relay derives it only for the JSONB column).
		set(metadata.EventDataContentType, "application/json")
	}
	for k, v := range ev.Metadata {
		if k != metadata.EventID { // the event_id column is authoritative
			set(k, v)
		}
	}
	return md, isJSON
}

// dropDerived removes from md the keys whose value the relay derives
// anyway (a TxPublisher message carries them all), so they are not stored
// twice; ce_time is kept, created_at is not known yet. It returns md (nil
// when empty).
func dropDerived(ev Event, aggID string, isJSON bool, md map[string]string) map[string]string {
	eventmeta.Derived(ev.ID, ev.AggregateType, aggID, ev.EventType, isJSON, time.Time{}, func(k, v string) {
		if sv, ok := md[k]; ok && sv == v && k != metadata.EventTime {
			delete(md, k)
		}
	})
	if len(md) == 0 {
		md = nil
	}
	return md
}

// traceParentSize is a W3C traceparent, which the relay's span adds to an
// event stored without one when a tracer records.
var traceParentSize = strings.Repeat("0", len("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))

// checkWire checks the message the relay will publish for ev (stored
// metadata md, after dropDerived) against limits: its size as the kind
// counts it on the wire, with the metadata the relay derives (the longest
// ce_time, a traceparent when none is stored), and the kind's other rules.
func checkWire(limits transport.Limits, ev Event, aggID string, isJSON bool, md map[string]string) error {
	all := func(yield func(k, v string) bool) {
		for k, v := range md {
			if !yield(k, v) {
				return
			}
		}
		more := true
		eventmeta.Derived(ev.ID, ev.AggregateType, aggID, ev.EventType, isJSON, time.Time{}, func(k, v string) {
			if _, stored := md[k]; more && !stored {
				more = yield(k, v)
			}
		})
		if _, ok := md[metadata.TraceParent]; more && !ok {
			yield(metadata.TraceParent, traceParentSize)
		}
	}
	if err := limits.CheckMessage(ev.Topic, ev.ID, ev.Payload, all); err != nil {
		hint := "store large data elsewhere and send a reference"
		if errors.Is(err, transport.ErrMessageTooLarge) && limits.MaxBytes > 0 {
			hint += "; the limit is the outbox Writer's: build it with outbox.WriterConfig{Limits: <the relay's transport>.Limits()}, and WriterConfig.MaxEventBytes for a lower broker limit"
		}
		return fmt.Errorf("%w: %w: %s", ErrInvalidEvent, err, hint)
	}
	return nil
}

// appendMetadataJSON appends md as a JSON object of strings, as
// json.Marshal writes it (keys sorted), without its reflection. Add has
// refused NUL bytes and invalid UTF-8 before (checkNUL), so every byte is
// kept; invalid UTF-8 would be written as U+FFFD, as json.Marshal does.
func appendMetadataJSON(b []byte, md map[string]string) []byte {
	b = append(b, '{')
	for i, k := range slices.Sorted(maps.Keys(md)) {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = appendJSONString(b, md[k])
	}
	return append(b, '}')
}

func appendJSONString(b []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}

// ErrCaptureActive is returned (wrapped, with the slot or trigger and the
// fix) by RetryFailed and the console's retry while Debezium capture is on
// (package outbox/capture).
var ErrCaptureActive = storage.ErrCaptureActive
