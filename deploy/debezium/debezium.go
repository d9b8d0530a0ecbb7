// Package debezium holds the Kafka Connect configuration of Debezium's
// PostgreSQL connector relaying millwright's outbox (outbox-connector.json,
// explained setting by setting in README.md), and its tests: the same
// events relayed by millwright's relay and by Debezium must be the same
// Kafka records, and a running system must switch from one to the other
// and back losing nothing.
package debezium

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"maps"
)

//go:embed outbox-connector.json
var connectorJSON []byte

// ConnectorConfig returns outbox-connector.json with overrides applied
// (the database, the outbox's schema, the slot, the publication).
func ConnectorConfig(overrides map[string]string) (map[string]string, error) {
	var cfg map[string]string
	if err := json.Unmarshal(connectorJSON, &cfg); err != nil {
		return nil, fmt.Errorf("deploy/debezium/outbox-connector.json: %w", err)
	}
	maps.Copy(cfg, overrides)
	return cfg, nil
}

// ForSchema returns the overrides of a connector named name relaying the
// outbox of schema in database dbname, through slot and publication.
func ForSchema(dbname, schema, slot, publication string) map[string]string {
	return map[string]string{
		"database.dbname":     dbname,
		"table.include.list":  schema + ".millwright_outbox",
		"column.include.list": schema + ".millwright_outbox.(id|event_id|topic|wire_key|wire_headers|wire_payload)",
		"slot.name":           slot,
		"publication.name":    publication,
		"topic.prefix":        slot,
	}
}
