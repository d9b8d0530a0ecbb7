package cloudevent

import (
	"errors"
	"fmt"
	"mime"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
)

// SpecVersion is the CloudEvents version millwright writes.
const SpecVersion = "1.0"

// Attributes are the CloudEvents context attributes millwright carries in
// message metadata (the metadata.Event* keys).
type Attributes struct {
	// ID is unique per event (metadata.EventID). Required.
	ID string
	// Source is the producing service, a URI-reference such as
	// "/orders-service" (metadata.EventSource). Required.
	Source string
	// Type is the versioned event type, "order.created.v1"
	// (metadata.EventType). Required.
	Type string
	// SpecVersion defaults to "1.0" in Apply.
	SpecVersion string
	// Time the event happened (metadata.EventTime, RFC 3339). Optional.
	Time time.Time
	// Subject is the aggregate id (metadata.EventSubject). Optional.
	Subject string
	// DataContentType is the payload's media type, "application/json"
	// (metadata.EventDataContentType). Optional.
	DataContentType string
}

// Apply writes the attributes into msg's metadata; empty ones are left
// unset. It does not validate: call Validate(msg) after, where wanted.
// A Time outside years 0000–9999 has no RFC 3339 form: Apply writes Go's
// text for it and Validate (which outbox.Add runs) refuses it, naming the
// metadata key, so no consumer is handed a time it cannot parse.
func (a Attributes) Apply(msg *message.Message) {
	set := func(k, v string) {
		if v != "" {
			msg.Metadata.Set(k, v)
		}
	}
	if a.SpecVersion == "" {
		a.SpecVersion = SpecVersion
	}
	set(metadata.EventID, a.ID)
	set(metadata.EventSource, a.Source)
	set(metadata.EventType, a.Type)
	set(metadata.EventSpecVersion, a.SpecVersion)
	if !a.Time.IsZero() {
		set(metadata.EventTime, a.Time.UTC().Format(time.RFC3339Nano))
	}
	set(metadata.EventSubject, a.Subject)
	set(metadata.EventDataContentType, a.DataContentType)
}

// FromMessage reads and validates msg's CloudEvents attributes.
func FromMessage(msg *message.Message) (Attributes, error) {
	if err := Validate(msg); err != nil {
		return Attributes{}, err
	}
	md := msg.Metadata
	a := Attributes{
		ID:              md.Get(metadata.EventID),
		Source:          md.Get(metadata.EventSource),
		Type:            md.Get(metadata.EventType),
		SpecVersion:     md.Get(metadata.EventSpecVersion),
		Subject:         md.Get(metadata.EventSubject),
		DataContentType: md.Get(metadata.EventDataContentType),
	}
	if t := md.Get(metadata.EventTime); t != "" {
		a.Time, _ = time.Parse(time.RFC3339Nano, t) // checked by Validate
	}
	return a, nil
}

// Validate reports every way msg's metadata is not a valid CloudEvents 1.0
// event in binary mode, each error naming the metadata key and the fix. It
// checks what the CloudEvents spec requires: id, source, type and
// specversion present and non-empty, specversion 1.0, source a
// URI-reference, time an RFC 3339 timestamp, datacontenttype an RFC 2046
// media type, subject non-empty when present.
func Validate(msg *message.Message) error {
	if msg == nil {
		return errors.New("cloudevent: message is nil")
	}
	md := msg.Metadata
	return ValidateFunc(msg.UUID, func(k string) (string, bool) {
		v, ok := md[k]
		return v, ok
	})
}

// ValidateFunc is Validate for metadata read through get (the value of a
// key and whether it is set), without building a message: the outbox
// checks each event at write time this way. uuid names the message in the
// errors.
func ValidateFunc(uuid string, get func(key string) (string, bool)) error {
	var errs []error
	required := func(k, hint string) string {
		v, ok := get(k)
		if !ok || v == "" {
			errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s is missing: set it (%s)", uuid, k, hint))
		}
		return v
	}
	required(metadata.EventID, "a unique id per event; the outbox sets it")
	if src := required(metadata.EventSource, `the producing service as a URI-reference, e.g. "/orders-service"`); src != "" {
		if _, err := url.Parse(src); err != nil {
			errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s %s is not a URI-reference: %v", uuid, metadata.EventSource, quote(src), shortErr(err)))
		}
	}
	if typ := required(metadata.EventType, `a versioned type such as "order.created.v1"`); typ != "" && strings.TrimSpace(typ) != typ {
		errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s %s has surrounding spaces", uuid, metadata.EventType, quote(typ)))
	}
	if sv := required(metadata.EventSpecVersion, `"1.0"`); sv != "" && sv != SpecVersion {
		errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s %s: want %q", uuid, metadata.EventSpecVersion, quote(sv), SpecVersion))
	}
	if t, ok := get(metadata.EventTime); ok {
		if _, err := time.Parse(time.RFC3339Nano, t); err != nil {
			errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s %s is not an RFC 3339 timestamp (want e.g. 2026-01-02T15:04:05Z)", uuid, metadata.EventTime, quote(t)))
		}
	}
	if s, ok := get(metadata.EventSubject); ok && s == "" {
		errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s is empty: remove it or set the aggregate id", uuid, metadata.EventSubject))
	}
	if ct, ok := get(metadata.EventDataContentType); ok {
		mt, _, err := mime.ParseMediaType(ct)
		if err == nil && !strings.Contains(mt, "/") {
			err = errors.New("no type/subtype")
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("cloudevent: message %s: metadata %s %s is not a media type (want e.g. application/json): %v", uuid, metadata.EventDataContentType, quote(ct), shortErr(err)))
		}
	}
	return errors.Join(errs...)
}

// maxQuoted bounds how much of a hostile value an error quotes.
const maxQuoted = 64

// quote quotes v for an error message, cut to maxQuoted bytes.
func quote(v string) string {
	if len(v) <= maxQuoted {
		return strconv.Quote(v)
	}
	return fmt.Sprintf("%q... (%d bytes)", v[:maxQuoted], len(v))
}

// shortErr is err's text cut to a bounded length: parse errors quote the
// whole input.
func shortErr(err error) string {
	s := err.Error()
	if len(s) <= 4*maxQuoted {
		return s
	}
	return s[:4*maxQuoted] + "..."
}
