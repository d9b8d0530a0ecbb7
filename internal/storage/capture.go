package storage

import (
	"context"
	"fmt"

	"github.com/lib/pq"
)

// Change data capture of the outbox (Debezium's outbox event router; see
// outbox/migrations/008_outbox_cdc.sql and deploy/debezium/README.md).

// EnableCapture creates, if missing, the trigger that fills the outbox's
// wire_* columns and the publication (inserts only: the router has no use
// for the relay's updates and deletes) a connector streams. CREATE TRIGGER
// waits for the writing transactions in flight: every row inserted after
// it returns has its wire columns.
func EnableCapture(ctx context.Context, q Querier, publication string) error {
	if _, err := q.Exec(ctx, S(`CREATE OR REPLACE TRIGGER millwright_outbox_capture
    BEFORE INSERT ON millwright_outbox
    FOR EACH ROW EXECUTE FUNCTION millwright_outbox_capture()`)); err != nil {
		return fmt.Errorf("creating the capture trigger (did `millwright migrate` run?): %w", err)
	}
	var n int64
	if err := q.QueryRow(ctx, S(`SELECT count(*) FROM pg_publication WHERE pubname = $1`, publication), &n); err != nil {
		return err
	}
	if n > 0 {
		return nil
	}
	// publish_via_partition_root: on the partitioned layout the records
	// name millwright_outbox, not its partitions.
	_, err := q.Exec(ctx, S(`CREATE PUBLICATION `+pq.QuoteIdentifier(publication)+
		` FOR TABLE millwright_outbox WITH (publish = 'insert', publish_via_partition_root = true)`))
	if err != nil {
		return fmt.Errorf("creating publication %q: %w", publication, err)
	}
	return nil
}

// DisableCapture drops the capture trigger and the publication (rows keep
// the wire columns they have).
func DisableCapture(ctx context.Context, q Querier, publication string) error {
	if _, err := q.Exec(ctx, S(`DROP TRIGGER IF EXISTS millwright_outbox_capture ON millwright_outbox`)); err != nil {
		return err
	}
	_, err := q.Exec(ctx, S(`DROP PUBLICATION IF EXISTS `+pq.QuoteIdentifier(publication)))
	return err
}

// CreateCaptureSlot creates the logical replication slot (pgoutput) a
// connector streams from, and returns its consistent point: the connector
// delivers the rows committed after it. A slot that exists is kept and
// its confirmed position returned.
func CreateCaptureSlot(ctx context.Context, q Querier, slot string) (string, error) {
	var lsn string
	err := q.QueryRow(ctx, S(`SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot), &lsn)
	if err == nil {
		return lsn, nil
	}
	if !IsNoRows(err) {
		return "", err
	}
	if err := q.QueryRow(ctx, S(`SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`, slot), &lsn); err != nil {
		return "", fmt.Errorf("creating replication slot %q (wal_level must be logical): %w", slot, err)
	}
	// A mark older than the slot would look confirmed (its position is
	// before the slot's), though the connector never saw its rows.
	if _, err := q.Exec(ctx, S(`DELETE FROM millwright_outbox_capture_marks`)); err != nil {
		return "", err
	}
	return lsn, nil
}

// DropCaptureSlot drops the slot if it exists and no connector holds it.
// A slot nobody reads retains WAL without bound: drop it when its
// connector is gone for good.
func DropCaptureSlot(ctx context.Context, q Querier, slot string) error {
	_, err := q.Exec(ctx, S(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot))
	return err
}

// CaptureMark is a moment of the outbox: the WAL insert position and the
// snapshot, taken by one statement (the snapshot first, the position
// after it, so every transaction the snapshot sees committed before Lsn).
type CaptureMark struct {
	ID  int64
	Lsn string
}

// TakeCaptureMark records a capture mark.
func TakeCaptureMark(ctx context.Context, q Querier) (CaptureMark, error) {
	var m CaptureMark
	err := q.QueryRow(ctx, S(`INSERT INTO millwright_outbox_capture_marks (lsn, snap)
    VALUES (pg_current_wal_insert_lsn(), pg_current_snapshot()) RETURNING id, lsn::text`), &m.ID, &m.Lsn)
	return m, err
}

// visibleIn is the predicate of an outbox row visible in the snapshot of
// the capture mark m (an alias of millwright_outbox_capture_marks).
const visibleIn = `pg_visible_in_snapshot(millwright_xid8(o.xmin, pg_snapshot_xmax(m.snap)), m.snap)`

// CountPendingBefore counts the pending rows visible in mark id's
// snapshot: the rows committed before it that the relay has not published
// yet. On the way to Debezium the relay keeps running until this is 0 for
// a mark taken after the slot was created.
func CountPendingBefore(ctx context.Context, q Querier, mark int64) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM millwright_outbox o, millwright_outbox_capture_marks m
    WHERE m.id = $1 AND o.status = 'pending' AND `+visibleIn, mark), &n)
	return n, err
}

// MarkCaptured marks published the pending rows that slot's connector has
// delivered: those visible in the newest capture mark at or before the
// slot's confirmed_flush_lsn. Older marks are deleted. It returns the rows
// marked and the mark used (0: none is confirmed yet).
func MarkCaptured(ctx context.Context, q Querier, slot string) (rows int64, mark int64, err error) {
	err = q.QueryRow(ctx, S(`SELECT coalesce(max(m.id), 0) FROM millwright_outbox_capture_marks m, pg_replication_slots s
    WHERE s.slot_name = $1 AND m.lsn <= s.confirmed_flush_lsn`, slot), &mark)
	if err != nil || mark == 0 {
		return 0, 0, err
	}
	rows, err = q.Exec(ctx, S(`UPDATE millwright_outbox o SET status = 'published', published_at = now()
    FROM millwright_outbox_capture_marks m
    WHERE m.id = $1 AND o.status = 'pending' AND `+visibleIn, mark))
	if err != nil {
		return 0, 0, fmt.Errorf("marking captured rows published: %w", err)
	}
	_, err = q.Exec(ctx, S(`DELETE FROM millwright_outbox_capture_marks WHERE id < $1`, mark))
	return rows, mark, err
}

// SlotLag is one replication slot's cost: the WAL Postgres keeps for it.
type SlotLag struct {
	Slot     string
	Active   bool
	Retained int64 // bytes of WAL from its restart_lsn to the current position
}

// ReadSlotLag lists the database's logical replication slots with the
// WAL each retains (pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)).
func ReadSlotLag(ctx context.Context, q Querier) ([]SlotLag, error) {
	var out []SlotLag
	err := q.Query(ctx, S(`SELECT slot_name::text, active,
    coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint
    FROM pg_replication_slots WHERE database = current_database() ORDER BY slot_name`), func(r Row) error {
		var s SlotLag
		if err := r.Scan(&s.Slot, &s.Active, &s.Retained); err != nil {
			return err
		}
		out = append(out, s)
		return nil
	})
	return out, err
}

// TruncateOutbox empties the outbox: `millwright bench debezium` between
// its measurements, in its scratch schema. Never on a live outbox.
func TruncateOutbox(ctx context.Context, q Querier) error {
	_, err := q.Exec(ctx, S(`TRUNCATE millwright_outbox`))
	return err
}

// CountUnpublished counts the rows not published yet (pending or failed).
func CountUnpublished(ctx context.Context, q Querier) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`), &n)
	return n, err
}
