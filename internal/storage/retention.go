package storage

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// RetentionTable is what a cleaner deletes old rows from: the SQL
// fragments of its DELETE, its lock, and its partition mode. The tables
// millwright cleans are the variables below; package retention's tests
// define their own.
type RetentionTable struct {
	// Name is the table, unqualified: it is found on the search_path.
	Name string
	// Key identifies a row in the DELETE: its primary key, or "ctid".
	Key string
	// Where selects the rows to delete; $1 is the retention in
	// milliseconds (int8). An index must serve it.
	Where string
	// OrderBy, optional, orders each batch's sub-select.
	OrderBy string
	// LockClass is the first key of the session advisory lock held while
	// a round runs; the second is hashtext(current_schema()), so cleaners
	// of different schemas do not exclude each other. One per table.
	LockClass int32
	// Partitions, optional, is the partition mode (PartitionSpec).
	Partitions *PartitionSpec
}

// PartitionSpec is the partition mode of a RetentionTable: when the table
// is partitioned by range on a timestamptz column by UTC day, whole
// partitions are dropped instead of rows deleted.
type PartitionSpec struct {
	// Keep lists predicates of rows that keep their partition from being
	// dropped ("status = 'pending'"); an index should serve each.
	Keep []string
	// With, optional, is the storage parameters of new partitions
	// ("fillfactor = 70").
	With string
}

// The tables millwright's cleaners clean.
var (
	// OutboxRetention deletes published rows by walking the primary key
	// from the oldest row: old published rows sit at its start, so each
	// batch reads little more than it deletes. Pending and failed rows
	// are never deleted; on the partitioned layout no partition holding
	// one is dropped.
	OutboxRetention = RetentionTable{
		Name: "millwright_outbox", Key: "id", OrderBy: "id",
		Where:      `status = 'published' AND published_at < now() - $1 * interval '1 millisecond'`,
		LockClass:  0x6d774f43, // "mwOC"
		Partitions: &PartitionSpec{Keep: []string{"status = 'pending'", "status = 'failed'"}, With: "fillfactor = 70"},
	}
	// SagaRetention deletes finished sagas (their steps go by the foreign
	// key's cascade); served by millwright_saga_instances_finished_idx.
	SagaRetention = RetentionTable{
		Name: "millwright_saga_instances", Key: "id", OrderBy: "updated_at",
		Where:     `state IN ('completed', 'compensated') AND updated_at < now() - $1 * interval '1 millisecond'`,
		LockClass: 0x6d775347, // "mwSG"
	}
	// IdempotencyRetention deletes processed marks by ctid: the table's key
	// is (consumer, event_id), and a ctid IN (...) delete is a TID scan.
	IdempotencyRetention = RetentionTable{
		Name: "millwright_processed_events", Key: "ctid",
		Where:     `processed_at < now() - $1 * interval '1 millisecond'`,
		LockClass: 0x6d775045, // "mwPE"
	}
	// DLQRetention deletes dead letters recorded before the retention;
	// served by millwright_dead_letters_created_idx.
	DLQRetention = RetentionTable{
		Name: "millwright_dead_letters", Key: "id", OrderBy: "created_at",
		Where:     `created_at < now() - $1 * interval '1 millisecond'`,
		LockClass: 0x6d77444c, // "mwDL"
	}
	// AuditRetention deletes audit rows; served by millwright_audit_at_idx.
	AuditRetention = RetentionTable{
		Name: "millwright_audit", Key: "id", OrderBy: "at",
		Where:     `at < now() - $1 * interval '1 millisecond'`,
		LockClass: 0x6d774155, // "mwAU"
	}
)

// DeleteRetainedStatement is the statement that deletes at most limit
// rows of t older than retention, skipping rows locked by others (writers
// never wait on a cleaner).
func DeleteRetainedStatement(t RetentionTable, retention time.Duration, limit int) Statement {
	order := ""
	if t.OrderBy != "" {
		order = " ORDER BY " + t.OrderBy
	}
	s := S(`DELETE FROM `+t.Name+` WHERE `+t.Key+` IN (SELECT `+t.Key+` FROM `+t.Name+
		` WHERE `+t.Where+order+` LIMIT $2 FOR UPDATE SKIP LOCKED)`, retention.Milliseconds(), limit)
	s.What = "deleting a batch of " + t.Name
	return s
}

// DeleteRetained deletes one batch (DeleteRetainedStatement) and returns
// the rows deleted. Outside a transaction the batch is its own.
func DeleteRetained(ctx context.Context, q Querier, t RetentionTable, retention time.Duration, limit int) (int64, error) {
	return q.Exec(ctx, DeleteRetainedStatement(t, retention, limit))
}

// CountRetained counts the rows of t that DeleteRetained would delete.
func CountRetained(ctx context.Context, q Querier, t RetentionTable, retention time.Duration) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM `+t.Name+` WHERE `+t.Where, retention.Milliseconds()), &n)
	return n, err
}

// TryRetentionLock takes t's session advisory lock in the schema of q's
// session without waiting, and reports whether it got it. q must be one
// session (a Session), which RetentionUnlock releases it on.
func TryRetentionLock(ctx context.Context, q Querier, t RetentionTable) (bool, error) {
	var locked bool
	err := q.QueryRow(ctx, S(`SELECT pg_try_advisory_lock(`+strconv.Itoa(int(t.LockClass))+`, hashtext(current_schema()))`), &locked)
	return locked, err
}

// RetentionUnlock releases the lock TryRetentionLock took on q.
func RetentionUnlock(ctx context.Context, q Querier, t RetentionTable) error {
	_, err := q.Exec(ctx, S(`SELECT pg_advisory_unlock(`+strconv.Itoa(int(t.LockClass))+`, hashtext(current_schema()))`))
	return err
}

// Session is one connection of a Pool, held until Release: what a session
// advisory lock needs, and the statements and transactions of the round
// that holds it. It is not safe for concurrent use.
type Session struct {
	Querier
	begin   func(ctx context.Context) (Tx, error)
	release func()
}

// AcquireSession takes a connection of p (a Pool of NewSQLPool or
// NewPgxPool) for the caller alone.
func AcquireSession(ctx context.Context, p Pool) (*Session, error) {
	switch h := p.Handle().(type) {
	case *sql.DB:
		conn, err := h.Conn(ctx)
		if err != nil {
			return nil, err
		}
		return &Session{
			Querier: sqlQuerier{conn},
			begin: func(ctx context.Context) (Tx, error) {
				tx, err := conn.BeginTx(ctx, nil)
				if err != nil {
					return nil, err
				}
				return &sqlTx{sqlQuerier{tx}, tx}, nil
			},
			release: func() { _ = conn.Close() },
		}, nil
	case *pgxpool.Pool:
		conn, err := h.Acquire(ctx)
		if err != nil {
			return nil, err
		}
		return &Session{
			Querier: pgxQuerier{conn},
			begin: func(ctx context.Context) (Tx, error) {
				tx, err := conn.Begin(ctx)
				if err != nil {
					return nil, err
				}
				return &pgxTx{pgxQuerier: pgxQuerier{tx}, tx: tx}, nil
			},
			release: conn.Release,
		}, nil
	}
	return nil, fmt.Errorf("%w: %T holds no *sql.DB nor *pgxpool.Pool to take a session of", ErrUnsupported, p.Handle())
}

// Begin starts a transaction on the session; it ends before Release.
func (s *Session) Begin(ctx context.Context) (Tx, error) { return s.begin(ctx) }

// Release gives the connection back to its pool. It is idempotent.
func (s *Session) Release() {
	if s.release != nil {
		s.release()
		s.release = nil
	}
}
