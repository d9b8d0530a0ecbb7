// Package eventmeta is what the outbox's write side and its relay must
// agree on: the metadata of an event that its row's columns give. Add does
// not store it (outbox), the relay derives it when it publishes the row
// (outbox/relay).
package eventmeta

import (
	"time"

	"github.com/millwright/millwright/metadata"
)

// Derived calls set with the metadata of an event that its row's
// columns give, and that Add therefore does not store in the metadata
// column: the CloudEvents id, specversion, time (created_at, the writing
// transaction's start; the zero time stands for the longest value), subject,
// type and datacontenttype, the aggregate and the ordering key. Stored
// metadata wins over these, except the id.
func Derived(eventID, aggType, aggID, eventType string, isJSON bool, created time.Time, set func(k, v string)) {
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
		set(metadata.OrderingKey, OrderingKey(aggType, aggID))
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

// OrderingKey is the metadata.OrderingKey of an aggregate.
func OrderingKey(aggType, aggID string) string {
	if aggType == "" {
		return aggID
	}
	return aggType + "/" + aggID
}
