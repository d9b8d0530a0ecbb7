package transport

import (
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/sqlschema"
)

// BatchPublisher is the optional ability of a publisher to send many
// messages to one topic in one round trip. The outbox relay uses it when the
// transport's publisher has it and falls back to Publish otherwise.
//
// Implementations must be safe for concurrent use. Messages with the same
// metadata.OrderingKey keep their relative order, also under partial
// failure: after a message of a key fails, no later message of that key
// in the call reaches the broker (they are reported failed), so that
// publishing the failed ones again keeps each key in order for a consumer
// that drops duplicates. PublishBatch returns nil
// when all were accepted; when only some were, a *BatchError naming the
// failed ones; any other error means none can be assumed published.
type BatchPublisher = batch.Publisher

// BatchError reports which messages of a PublishBatch call were not published.
type BatchError = batch.Error

// InDatabasePublisher is the optional ability of a publisher whose broker
// is a Postgres database (kind sql) to publish rows that are already in
// that database: the outbox relay, when its table lives in the same
// database, moves a claimed batch into the topic's table with one INSERT
// ... SELECT in the transaction that marks the batch published, instead of
// reading the rows out and publishing them (no duplicates, no per-message
// work outside the database). Its methods: DB (the database it writes
// to), PrepareTopic (create a topic's table) and Table (that table's
// name); the statement itself is internal (internal/sqlschema).
//
// Implementations must be safe for concurrent use.
type InDatabasePublisher = sqlschema.Publisher
