// Package capture lets Debezium relay the outbox instead of
// outbox/relay, and switches between the two without losing or repeating
// an event.
//
// Debezium's outbox event router on Kafka Connect can relay the outbox's
// table instead of a relay (package outbox/relay), with records a consumer cannot tell from the relay's
// (same topic, key, partition, headers and payload bytes; Kafka only).
// SwitchToDebezium (`millwright outbox switch-to-debezium`) creates the
// row trigger that fills the wire_key, wire_headers and wire_payload
// columns the router reads (migration 008) and records each row's
// inserting transaction (migration 009), an insert-only publication, and
// the replication slot with its boundary, and waits for the relays to
// publish the rows from before it; SwitchToRelay hands the outbox back.
// Writers change nothing, and pay the trigger only while capture is on.
// Debezium does not mark rows published: a Tracker beside the
// connector does, from capture marks its slot has confirmed, for the rows
// inserted after the boundary only (never judged by a later update), so
// that retention and a relay started again work; it also exports
// MetricSlotRetainedWAL. outbox.RetryFailed is refused while capture is on
// (outbox.ErrCaptureActive): the connector never streams an update. Guarantees on that
// path are Debezium's (at-least-once, commit order, per-key order on the
// topic); no retry budget, no failed state, no dead letters. The
// connector's configuration: deploy/debezium; switching relays without
// losing an event: docs/operations.md, "Relaying with Debezium".
package capture
