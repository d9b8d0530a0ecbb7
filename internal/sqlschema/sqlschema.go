// Package sqlschema is watermill-sql's table layout as millwright's sql
// transport uses it (wsql.DefaultPostgreSQLSchema: one table per topic),
// and the one statement that publishes rows already in the database into
// such a table. The outbox relay and transport/sql both import it, so the
// layout is written down once and no public interface carries SQL text.
package sqlschema

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Columns a query passed to InsertSelect selects.
const (
	// ColUUID is the message UUID (text).
	ColUUID = "uuid"
	// ColPayload is the payload (bytea).
	ColPayload = "payload"
	// ColMetadata is the metadata (json: an object of strings).
	ColMetadata = "metadata"
	// ColPosition orders the messages (any ordered type): the topic's
	// offsets follow it.
	ColPosition = "position"
)

// InsertSelect returns the statement that publishes to table (a topic's
// table, schema-qualified and quoted, from Publisher.Table) the rows query
// selects, in ColPosition order. It runs in the caller's transaction: the
// messages are published when it commits, and not at all if it rolls back.
// The columns are DefaultPostgreSQLSchema's; transaction_id is what
// watermill-sql's subscriber orders commits by.
func InsertSelect(table, query string) string {
	return `INSERT INTO ` + table + ` (uuid, payload, metadata, transaction_id)
SELECT q.` + ColUUID + `, q.` + ColPayload + `, q.` + ColMetadata + `, pg_current_xact_id() FROM (` + query + `) q ORDER BY q.` + ColPosition
}

// Publisher is the optional ability of a publisher whose broker is a
// Postgres database (kind sql) to publish rows that are already in that
// database: the outbox relay, when its table lives in the same database,
// moves a claimed batch into the topic's table with InsertSelect in the
// transaction that marks the batch published. transport.InDatabasePublisher
// is this interface.
//
// Implementations must be safe for concurrent use.
type Publisher interface {
	message.Publisher
	// DB is the database the publisher writes to. A caller runs
	// InsertSelect on its own connection only after checking that the
	// connection reaches this same database.
	DB() *sql.DB
	// PrepareTopic creates topic's table if needed, on DB (so not from
	// inside a transaction that holds DB's last free connection). It is
	// cheap once a topic is prepared.
	PrepareTopic(ctx context.Context, topic string) error
	// Table returns, without I/O, the schema-qualified, quoted name of a
	// prepared topic's table, the same on any connection to DB, and an
	// error for a topic not prepared yet (by any caller): the relay asks
	// it whether a topic needs PrepareTopic.
	Table(topic string) (string, error)
}
