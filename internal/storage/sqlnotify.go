package storage

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// The sql transport's wake-up (transport/sql): a statement-level trigger
// on each watermill-sql messages table NOTIFYs SQLNotifyChannel at the
// commit of every transaction that inserted into it, whoever the writer is
// (watermill-sql's publisher on the transport's pool or on a user's
// transaction, the outbox relay's in-database INSERT ... SELECT). The
// payload says which table and which transaction: "<table oid> <xid8>".
// NOTIFY is transactional: a rolled-back insert notifies nobody, and
// Postgres folds the identical notifications of one transaction into one.

// SQLNotifyChannel is the channel every sql-transport table notifies: one
// LISTEN connection per transport, whatever the number of topics.
const SQLNotifyChannel = "millwright_sql"

// sqlNotifyFunction is the trigger function, created in the first schema
// of the search_path (where watermill-sql creates its tables) unless it
// exists there; concurrent creators race on pg_proc's unique index, which
// TolerateExisting retries, and the retry then finds the function.
const sqlNotifyFunction = `IF NOT EXISTS (SELECT 1 FROM pg_proc p WHERE p.proname = 'millwright_sql_notify'
	AND p.pronamespace = current_schema()::regnamespace AND p.pronargs = 0) THEN
CREATE FUNCTION millwright_sql_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
	PERFORM pg_notify('` + SQLNotifyChannel + `', TG_RELID::text || ' ' || pg_current_xact_id()::text);
	RETURN NULL;
END $fn$;
END IF`

// SQLNotifySchemaStatements returns the statements that give the messages
// table quotedTable (as watermill-sql's schema adapter names it, after its
// CREATE TABLE) the wake-up trigger: idempotent, safe to run concurrently
// (each is wrapped by TolerateExisting), without arguments.
func SQLNotifySchemaStatements(quotedTable string) []string {
	lit := "'" + strings.ReplaceAll(quotedTable, "'", "''") + "'"
	trigger := `IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = ` + lit + `::regclass AND tgname = 'millwright_notify') THEN
CREATE TRIGGER millwright_notify AFTER INSERT ON ` + quotedTable + ` FOR EACH STATEMENT EXECUTE FUNCTION millwright_sql_notify();
END IF`
	return []string{TolerateExisting(sqlNotifyFunction), TolerateExisting(trigger)}
}

// ParseSQLNotification reads a payload of the trigger: the table's oid and
// the inserting transaction's id. ok is false for a payload of another
// form (another writer on the channel).
func ParseSQLNotification(payload string) (table uint32, xid uint64, ok bool) {
	o, x, found := strings.Cut(payload, " ")
	if !found {
		return 0, 0, false
	}
	t, err := strconv.ParseUint(o, 10, 32)
	if err != nil {
		return 0, 0, false
	}
	if xid, err = strconv.ParseUint(x, 10, 64); err != nil {
		return 0, 0, false
	}
	return uint32(t), xid, true
}

// TableOID returns the oid of the table quotedTable names on q's
// search_path (no row when it does not exist): what the trigger's
// notifications name it by.
func TableOID(ctx context.Context, q Querier, quotedTable string) (uint32, error) {
	var oid int64
	if err := q.QueryRow(ctx, S(`SELECT COALESCE(to_regclass($1::text)::oid::int8, 0)`, quotedTable), &oid); err != nil {
		return 0, err
	}
	if oid <= 0 || oid > int64(^uint32(0)) {
		return 0, fmt.Errorf("storage: table %s has no oid", quotedTable)
	}
	return uint32(oid), nil
}

// SnapshotXmin returns pg_snapshot_xmin of a fresh snapshot: every
// transaction with a lower id has ended, so watermill-sql's consumers,
// which read only rows below it, can read what those transactions
// inserted.
func SnapshotXmin(ctx context.Context, q Querier) (uint64, error) {
	var s string
	if err := q.QueryRow(ctx, S(`SELECT pg_snapshot_xmin(pg_current_snapshot())::text`), &s); err != nil {
		return 0, err
	}
	return strconv.ParseUint(s, 10, 64)
}
