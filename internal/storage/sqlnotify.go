package storage

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// The sql transport's wake-up (transport/sql): a statement-level trigger
// on each watermill-sql messages table NOTIFYs SQLNotifyChannel at the
// commit of every transaction that inserted into it while a consumer holds
// the table's wake-up lock (SQLWakeLock), whoever the writer is
// (watermill-sql's publisher on the transport's pool or on a user's
// transaction, the outbox relay's in-database INSERT ... SELECT). The
// payload says which table and which transaction: "<table oid> <xid8>".
// NOTIFY is transactional: a rolled-back insert notifies nobody, and
// Postgres folds the identical notifications of one transaction into one.

// SQLNotifyChannel is the channel every sql-transport table notifies: one
// LISTEN connection per transport, whatever the number of topics.
const SQLNotifyChannel = "millwright_sql"

// SQLWakeLockClass is the first half of the sql transport's wake-up lock
// key ("mwsq" in ASCII; the outbox's is "mwox"); the second is the
// messages table's oid, as int4.
const SQLWakeLockClass = 1836544881

// sqlNotifyFunction is the trigger function, created in the first schema
// of the search_path (where watermill-sql creates its tables) unless it
// exists there in this form (an older one, which always notified, is
// replaced). A writing statement tries to take the table's wake-up lock
// shared, without waiting, until its transaction ends; it notifies only
// when it cannot: a consumer holds it exclusively, i.e. waits. NOTIFY
// serialises commits, so writers must not notify while nobody waits. No
// wake-up is lost: a consumer takes the lock only after every writer
// holding it shared has ended, and looks at the table after taking it.
// Concurrent creators race on pg_proc's unique index (retried; the retry
// then finds the function), concurrent replacers on its row ("tuple
// concurrently updated", retried likewise).
const sqlNotifyFunction = `DO $mw$ BEGIN FOR attempt IN 1..10 LOOP BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_proc p WHERE p.proname = 'millwright_sql_notify'
	AND p.pronamespace = current_schema()::regnamespace AND p.pronargs = 0
	AND p.prosrc LIKE '%pg_try_advisory_xact_lock_shared%') THEN
CREATE OR REPLACE FUNCTION millwright_sql_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
	IF NOT pg_try_advisory_xact_lock_shared(` + sqlWakeLockClassText + `, TG_RELID::int4) THEN
		PERFORM pg_notify('` + SQLNotifyChannel + `', TG_RELID::text || ' ' || pg_current_xact_id()::text);
	END IF;
	RETURN NULL;
END $fn$;
END IF;
EXIT;
EXCEPTION WHEN unique_violation OR duplicate_function OR internal_error THEN IF attempt = 10 THEN RAISE; END IF;
END; END LOOP; END $mw$`

const sqlWakeLockClassText = "1836544881" // SQLWakeLockClass

// SQLNotifySchemaStatements returns the statements that give the messages
// table quotedTable (as watermill-sql's schema adapter names it, after its
// CREATE TABLE) the wake-up trigger: idempotent, safe to run concurrently
// (each is wrapped by TolerateExisting), without arguments.
func SQLNotifySchemaStatements(quotedTable string) []string {
	lit := "'" + strings.ReplaceAll(quotedTable, "'", "''") + "'"
	trigger := `IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = ` + lit + `::regclass AND tgname = 'millwright_notify') THEN
CREATE TRIGGER millwright_notify AFTER INSERT ON ` + quotedTable + ` FOR EACH STATEMENT EXECUTE FUNCTION millwright_sql_notify();
END IF`
	return []string{sqlNotifyFunction, TolerateExisting(trigger)}
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

// SQLWakeLock is the wake-up lock of one messages table: a session
// advisory lock the transport holds exclusively, on a connection of its
// own, while its subscriptions on the table wait. Its statements carry no
// parameters (one round trip with lib/pq).
type SQLWakeLock struct {
	try, unlock string
	table       string // quoted, as watermill-sql's schema adapter names it
}

// Wake-up lock states SQLWakeLock.Try reports.
const (
	SQLWakeHeld    = "held"    // this session holds it now
	SQLWakeOther   = "other"   // another session holds it exclusively
	SQLWakeWriters = "writers" // writers hold it shared
)

// NewSQLWakeLock returns the wake-up lock of the messages table oid
// (quotedTable, as watermill-sql's schema adapter names it).
func NewSQLWakeLock(oid uint32, quotedTable string) SQLWakeLock {
	key := sqlWakeLockClassText + ", " + strconv.Itoa(int(int32(oid)))
	return SQLWakeLock{
		try: `SELECT CASE
		WHEN pg_try_advisory_lock(` + key + `) THEN 'held'
		WHEN EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid = ` + sqlWakeLockClassText + ` AND objid = '` + strconv.FormatUint(uint64(oid), 10) + `'::oid AND objsubid = 2)
		THEN 'other' ELSE 'writers' END`,
		// The handover: consumers relying on this session's lock (other
		// processes') wake and one takes it. Payload "<oid> 0 <pid>"
		// (ParseSQLHandover), which ParseSQLNotification refuses.
		unlock: `SELECT pg_advisory_unlock(` + key + `), pg_notify('` + SQLNotifyChannel + `', '` +
			strconv.FormatUint(uint64(oid), 10) + ` 0 ' || pg_backend_pid())`,
		table: quotedTable,
	}
}

// Table is the quoted name of the lock's messages table.
func (w SQLWakeLock) Table() string { return w.table }

// SQLWakeLocksHeld returns the tables (oids) whose wake-up lock q's
// session holds exclusively (q: one connection). A session the server
// ended fails; one that lost a lock otherwise (a pooler that swapped the
// server session) lacks it.
func SQLWakeLocksHeld(ctx context.Context, q Querier) (map[uint32]struct{}, error) {
	held := map[uint32]struct{}{}
	err := q.Query(ctx, Statement{SQL: `SELECT objid::int8 FROM pg_locks WHERE pid = pg_backend_pid()
	AND locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted AND classid = ` + sqlWakeLockClassText + ` AND objsubid = 2`,
		Expect: NoExpect, What: "checking the sql wake-up locks' session"}, func(r Row) error {
		var oid int64
		if err := r.Scan(&oid); err != nil {
			return err
		}
		held[uint32(oid)] = struct{}{}
		return nil
	})
	return held, err
}

// Try takes the lock without waiting, on q (one connection: the lock is
// its session's), and reports SQLWakeHeld, SQLWakeOther or SQLWakeWriters.
func (w SQLWakeLock) Try(ctx context.Context, q Querier) (string, error) {
	var state string
	err := q.QueryRow(ctx, Statement{SQL: w.try, Expect: NoExpect, What: "taking the sql wake-up lock"}, &state)
	return state, err
}

// Unlock gives the lock back and notifies the table's handover.
func (w SQLWakeLock) Unlock(ctx context.Context, q Querier) error {
	_, err := q.Exec(ctx, Statement{SQL: w.unlock, Expect: NoExpect, What: "releasing the sql wake-up lock"})
	return err
}

// SQLWakeLook is what a consumer sees of its table in one snapshot, taken
// after it found the wake-up lock held (SQLWakeLock.Try).
type SQLWakeLook struct {
	// Backlog: consumer group's rows beyond its acked offset that
	// watermill-sql's query reads now (below the horizon).
	Backlog bool
	// Hidden is the highest transaction id of the table's committed rows
	// the horizon still hides (0: none); Horizon is the snapshot's xmin.
	Hidden, Horizon uint64
}

// Look reads, in one statement (one snapshot), whether consumer group
// group of the table has rows to read (watermill-sql's offsets rule:
// after (last_processed_transaction_id, offset_acked) in
// (transaction_id, offset) order, below pg_snapshot_xmin) in
// offsetsTable, which committed rows the horizon still hides, and the
// horizon. A group without an offsets row has no backlog (watermill-sql
// reads nothing for it either).
func (w SQLWakeLock) Look(ctx context.Context, q Querier, offsetsTable, group string) (SQLWakeLook, error) {
	st := S(`WITH o AS (SELECT offset_acked, last_processed_transaction_id AS tx FROM `+offsetsTable+` WHERE consumer_group = $1),
	h AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
SELECT EXISTS (SELECT 1 FROM `+w.table+` m, o, h WHERE m.transaction_id < h.xmin
		AND ((m.transaction_id = o.tx AND m."offset" > o.offset_acked) OR m.transaction_id > o.tx)),
	COALESCE((SELECT max(m.transaction_id)::text FROM `+w.table+` m, h WHERE m.transaction_id >= h.xmin), '0'),
	(SELECT xmin::text FROM h)`, group)
	st.Expect, st.What = NoExpect, "looking at a messages table under its wake-up lock"
	var l SQLWakeLook
	var hidden, horizon string
	if err := q.QueryRow(ctx, st, &l.Backlog, &hidden, &horizon); err != nil {
		return SQLWakeLook{}, err
	}
	var err error
	if l.Hidden, err = strconv.ParseUint(hidden, 10, 64); err != nil {
		return SQLWakeLook{}, err
	}
	if l.Horizon, err = strconv.ParseUint(horizon, 10, 64); err != nil {
		return SQLWakeLook{}, err
	}
	return l, nil
}

// ParseSQLHandover reads the payload SQLWakeLock.Unlock sends: the table
// whose lock was given back and the pid of the session that held it.
func ParseSQLHandover(payload string) (table uint32, pid int, ok bool) {
	f := strings.Fields(payload)
	if len(f) != 3 || f[1] != "0" {
		return 0, 0, false
	}
	t, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil {
		return 0, 0, false
	}
	if pid, err = strconv.Atoi(f[2]); err != nil {
		return 0, 0, false
	}
	return uint32(t), pid, true
}

// BackendPID returns the pid of q's session (q: one connection).
func BackendPID(ctx context.Context, q Querier) (int, error) {
	s, err := ThisSession(ctx, q)
	return s.PID, err
}

// BackendSession names a server session: its pid, and its start, which
// tells it from a later session given the same pid.
type BackendSession struct {
	PID   int
	Start string // pg_stat_activity.backend_start, in epoch seconds, as text
}

// ThisSession returns q's session (q: one connection).
func ThisSession(ctx context.Context, q Querier) (BackendSession, error) {
	var s BackendSession
	err := q.QueryRow(ctx, S(`SELECT pg_backend_pid(), COALESCE((SELECT extract(epoch FROM backend_start)::text FROM pg_stat_activity WHERE pid = pg_backend_pid()), '')`), &s.PID, &s.Start)
	return s, err
}

// EndSession ends session s (pg_terminate_backend) if it still runs, as
// the same session (pid and start), from q. A connection that went
// silent (a dropped NAT entry) leaves its session alive on the server,
// idle, until TCP keepalive finds it (hours by default), with its locks.
// It reports whether s was ended; ending another role's session needs
// pg_signal_backend.
func EndSession(ctx context.Context, q Querier, s BackendSession) (bool, error) {
	var ended bool
	err := q.QueryRow(ctx, S(`SELECT COALESCE(bool_or(pg_terminate_backend(pid)), false) FROM pg_stat_activity
	WHERE pid = $1 AND extract(epoch FROM backend_start)::text = $2 AND pid <> pg_backend_pid()`, s.PID, s.Start), &ended)
	return ended, err
}
