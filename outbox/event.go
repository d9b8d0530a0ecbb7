package outbox

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/lib/pq"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/tracing"
)

// Executor runs statements in the caller's transaction. *sql.Tx, *sql.DB
// and *sql.Conn satisfy it. Passing a *sql.DB writes the event in its own
// transaction, which gives up the outbox's atomicity with business writes.
type Executor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

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
	Metadata map[string]string
	// ID is the CloudEvents id (metadata.EventID) and the Watermill message
	// UUID. Default: a random UUID.
	ID string
	// Source is the CloudEvents source (metadata.EventSource), a
	// URI-reference such as "/orders-service". Default: DefaultSource().
	Source string
}

// DefaultMaxEventBytes is the default of MaxEventBytes: 1 MiB, Kafka's
// default message.max.bytes, the smallest limit among the transports
// (Pub/Sub takes 10 MB, RabbitMQ 128 MB by default).
const DefaultMaxEventBytes = 1 << 20

// MaxEventBytes bounds payload plus metadata of one event; Add and
// TxPublisher.Publish refuse a larger event with ErrInvalidEvent, at write
// time, in the business transaction, rather than leave the relay to find
// out from the broker. Set it once at start-up to your broker's limit (0
// or less: no limit).
var MaxEventBytes = func() *atomic.Int64 {
	var v atomic.Int64
	v.Store(DefaultMaxEventBytes)
	return &v
}()

// ErrInvalidEvent is returned (wrapped) by Add and TxPublisher.Publish for an
// event that cannot be stored; the message names the field to fix.
var ErrInvalidEvent = errors.New("invalid outbox event")

// maxRowsPerInsert bounds the size of one INSERT statement.
const maxRowsPerInsert = 1000

// Add writes events to the outbox through exec, normally the caller's
// transaction: they are published if and only if it commits. Several events
// are written with one multi-row INSERT per 1,000 events.
//
// Add fills in the CloudEvents metadata (id, type, source, subject, time,
// specversion, datacontenttype), the aggregate keys, and the W3C traceparent
// of the OpenTelemetry span in ctx when Event.Metadata has none.
//
// In a transaction of a pool from postgres.Open, the INSERT goes to the
// server with the transaction's next statement, normally its COMMIT, in
// the same round trip: the event then costs the business transaction no
// round trip of its own. Every later statement of the transaction sees
// the rows as if they had been inserted at once; only a server-side error
// of the INSERT (say, a schema without the outbox table) is returned by
// that statement or by Commit instead of by Add, and then nothing of the
// transaction commits. Events that fail Add's own checks (ErrInvalidEvent)
// are refused by Add itself, on every pool.
func Add(ctx context.Context, exec Executor, events ...Event) (err error) {
	ctx, span := tracing.StartWriteSpan(ctx, len(events))
	defer func() { tracing.EndSpan(span, err) }()
	if exec == nil {
		return fmt.Errorf("outbox: Add: nil Executor: pass the *sql.Tx of the business transaction")
	}
	for len(events) > 0 {
		n := min(len(events), maxRowsPerInsert)
		if err := insert(ctx, exec, events[:n]); err != nil {
			return err
		}
		events = events[n:]
	}
	return nil
}

func insert(ctx context.Context, exec Executor, events []Event) error {
	// Values are inlined as quoted literals: a statement without parameters
	// is one round trip with lib/pq instead of two, which is most of the
	// outbox's cost in the caller's transaction.
	var q strings.Builder
	q.WriteString(`INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, payload_raw, metadata) VALUES `)
	for i, ev := range events {
		row, err := prepare(ctx, ev)
		if err != nil {
			return fmt.Errorf("outbox: event %d (topic %q): %w", i, ev.Topic, err)
		}
		if i > 0 {
			q.WriteByte(',')
		}
		q.WriteByte('(')
		for j, v := range row {
			if j > 0 {
				q.WriteByte(',')
			}
			switch v := v.(type) {
			case nil:
				q.WriteString("NULL")
			case []byte:
				q.WriteString(pq.QuoteLiteral(`\x`+hex.EncodeToString(v)) + "::bytea")
			case string:
				q.WriteString(pq.QuoteLiteral(v))
			}
		}
		q.WriteByte(')')
	}
	// what names the statement in its error, here or, when it travels
	// with the transaction's next statement, in that one's.
	what := fmt.Sprintf("outbox: inserting %d event(s) into millwright_outbox (did `millwright migrate` run?)", len(events))
	if _, err := exec.ExecContext(pgconn.WithDeferred(ctx, what), q.String()); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// prepare validates ev and returns its row's arguments, in named steps:
// the defaults, the NUL check, the metadata to store, the CloudEvents
// check, the metadata the relay derives (not stored twice), and the size
// check.
func prepare(ctx context.Context, ev Event) ([]any, error) {
	if ev.Topic == "" {
		return nil, fmt.Errorf("%w: Topic is empty: set the topic the relay should publish to", ErrInvalidEvent)
	}
	ev, aggID := withDefaults(ev)
	if err := checkNUL(ev, aggID); err != nil {
		return nil, err
	}
	md, isJSON := storedMetadata(ctx, ev)
	if err := validateCloudEvent(ev, md); err != nil {
		return nil, err
	}
	md, derivedSize := dropDerived(ev, aggID, isJSON, md)
	var payload, raw any
	if isJSON {
		payload = string(ev.Payload)
	} else {
		if ev.Payload == nil {
			ev.Payload = []byte{}
		}
		raw = ev.Payload
	}
	mdJSON := appendMetadataJSON(nil, md)
	if err := checkSize(ev, len(mdJSON)+derivedSize); err != nil {
		return nil, err
	}
	return []any{ev.ID, ev.Topic, ev.AggregateType, aggID, ev.EventType, payload, raw, string(mdJSON)}, nil
}

// withDefaults fills in the ID, Source and EventType ev leaves empty, and
// returns it with its aggregate id: the event's own id when it has no
// aggregate.
func withDefaults(ev Event) (Event, string) {
	if ev.ID == "" {
		ev.ID = uuid.NewString()
	}
	if ev.Source == "" {
		ev.Source = DefaultSource()
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
// Postgres cannot store.
func checkNUL(ev Event, aggID string) error {
	for _, f := range [...]struct{ name, v string }{{"Topic", ev.Topic}, {"AggregateType", ev.AggregateType}, {"AggregateID", aggID}, {"EventType", ev.EventType}, {"ID", ev.ID}, {"Source", ev.Source}} {
		if strings.IndexByte(f.v, 0) >= 0 {
			return fmt.Errorf("%w: %s contains a NUL byte, which Postgres text cannot store", ErrInvalidEvent, f.name)
		}
	}
	for k, v := range ev.Metadata {
		if strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("%w: metadata %q contains a NUL byte, which Postgres JSONB cannot store", ErrInvalidEvent, k)
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
	// JSONB rejects the \u0000 escape: such payloads are kept as bytes.
	isJSON := !ev.RawPayload && json.Valid(ev.Payload) && !bytes.Contains(ev.Payload, []byte(`\u0000`))
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
// when empty) and the size of what the relay adds, for MaxEventBytes.
func dropDerived(ev Event, aggID string, isJSON bool, md map[string]string) (map[string]string, int) {
	derivedSize := 0
	derivedMetadata(ev.ID, ev.AggregateType, aggID, ev.EventType, isJSON, time.Time{}, func(k, v string) {
		if sv, ok := md[k]; ok {
			if sv != v || k == metadata.EventTime {
				return // stored, and wins
			}
			delete(md, k)
		}
		derivedSize += len(k) + len(v) + 6 // quotes, colon, comma
	})
	if len(md) == 0 {
		md = nil
	}
	return md, derivedSize
}

// checkSize refuses an event over MaxEventBytes: what the broker gets, the
// payload and mdSize bytes of metadata (stored and derived, with the
// longest ce_time).
func checkSize(ev Event, mdSize int) error {
	limit := MaxEventBytes.Load()
	if limit <= 0 {
		return nil
	}
	if size := int64(len(ev.Payload) + mdSize); size > limit {
		return fmt.Errorf("%w: event %s for topic %s is %d bytes (payload %d, metadata %d), over the limit of %d (outbox.MaxEventBytes; match it to your broker: Kafka message.max.bytes, Pub/Sub 10 MB): store large data elsewhere and send a reference",
			ErrInvalidEvent, ev.ID, ev.Topic, size, len(ev.Payload), mdSize, limit)
	}
	return nil
}

// derivedMetadata calls set with the metadata of an event that its row's
// columns give, and that Add therefore does not store in the metadata
// column: the CloudEvents id, specversion, time (created_at, the writing
// transaction's start; the zero time stands for the longest value), subject,
// type and datacontenttype, the aggregate and the ordering key. Stored
// metadata wins over these, except the id.
func derivedMetadata(eventID, aggType, aggID, eventType string, isJSON bool, created time.Time, set func(k, v string)) {
	set(metadata.EventID, eventID)
	set(metadata.EventSpecVersion, "1.0")
	if created.IsZero() {
		set(metadata.EventTime, "2006-01-02T15:04:05.999999-07:00")
	} else {
		set(metadata.EventTime, created.UTC().Format(time.RFC3339Nano))
	}
	if aggID != "" {
		set(metadata.EventSubject, aggID)
		set(metadata.AggregateID, aggID)
		set(metadata.OrderingKey, orderingKey(aggType, aggID))
	}
	if aggType != "" {
		set(metadata.AggregateType, aggType)
	}
	if eventType != "" {
		set(metadata.EventType, eventType)
	}
	if isJSON {
		set(metadata.EventDataContentType, "application/json")
	}
}

// orderingKey is the metadata.OrderingKey of an aggregate.
func orderingKey(aggType, aggID string) string {
	if aggType == "" {
		return aggID
	}
	return aggType + "/" + aggID
}

// appendMetadataJSON appends md as a JSON object of strings, as
// json.Marshal writes it (keys sorted, so that two keys that invalid UTF-8
// turns into the same U+FFFD text end alike), without its reflection. Add
// has refused NUL bytes before (JSONB cannot hold them).
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
