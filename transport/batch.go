package transport

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/batch"
)

// BatchPublisher is the optional ability of a publisher to send many
// messages to one topic in one round trip. The outbox relay uses it when the
// transport's publisher has it and falls back to Publish otherwise.
//
// Implementations must be safe for concurrent use. Messages with the same
// metadata.OrderingKey keep their relative order.
type BatchPublisher interface {
	message.Publisher
	// PublishBatch publishes msgs to topic. It returns nil when all were
	// accepted. When only some were, it returns a *BatchError naming the
	// failed ones; any other error means none can be assumed published.
	PublishBatch(topic string, msgs ...*message.Message) error
}

// BatchError reports which messages of a PublishBatch call were not published.
type BatchError = batch.Error

// InDatabasePublisher is the optional ability of a publisher whose broker
// is a Postgres database (kind sql) to publish rows that are already in
// that database: the outbox relay, when its table lives in the same
// database, moves a claimed batch into the topic's table with one INSERT
// ... SELECT in the transaction that marks the batch published, instead of
// reading the rows out and publishing them (no duplicates, no per-message
// work outside the database).
//
// Implementations must be safe for concurrent use.
type InDatabasePublisher interface {
	message.Publisher
	// DB is the database the publisher writes to. A caller runs
	// InsertSelect's statement on its own connection only after checking
	// that the connection reaches this same database.
	DB() *sql.DB
	// PrepareTopic creates topic's storage if needed, on DB (so not from
	// inside a transaction that holds DB's last free connection). It is
	// cheap once a topic is prepared.
	PrepareTopic(ctx context.Context, topic string) error
	// InsertSelect returns, without I/O, one statement that publishes to a
	// prepared topic the rows query selects, ordered by its column
	// position. query must select the columns uuid (text: the message
	// UUID), payload (bytea), metadata (json: an object of strings) and
	// position (any ordered type). The statement runs in the caller's
	// transaction: the messages are published when it commits, and not at
	// all if it rolls back.
	InsertSelect(topic, query string) (string, error)
}
