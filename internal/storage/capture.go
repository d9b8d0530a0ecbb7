package storage

import (
	"context"
	"errors"
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
		return fmt.Errorf("creating the capture trigger%s: %w", Hint(err), err)
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

// ErrCaptureActive is returned (wrapped) by ResetFailedEvents while
// Debezium capture is on: the publication streams inserts only, so a row
// put back to pending would never be sent by the connector.
var ErrCaptureActive = errors.New("Debezium capture is on")

// ErrSlotNotRegistered is returned (wrapped) by MarkCaptured for a slot no
// switch registered: without its boundary the rows it streams are unknown.
var ErrSlotNotRegistered = errors.New("replication slot not registered")

// CreateCaptureSlot creates, if missing, the logical replication slot
// (pgoutput) a connector streams from, and registers it, if it is not
// yet, with its boundary: a snapshot and WAL position taken after the slot
// exists (millwright_outbox_capture_slots, migration 009). It returns the
// boundary's position. A row whose inserting transaction the boundary
// sees is the relay's; any other committed after the slot's consistent
// point, and the slot streams it. The boundary is never older than the
// slot, whatever runs beside (a tracker's marks, a second switch): it is
// taken by a statement that starts after the slot exists.
func CreateCaptureSlot(ctx context.Context, q Querier, slot string) (string, error) {
	var n int64
	if err := q.QueryRow(ctx, S(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1::text`, slot), &n); err != nil {
		return "", err
	}
	// A registration left by a slot of the same name dropped by hand is
	// older than the slot created now: replace it. Any boundary taken after
	// the slot exists is right; a later one only leaves more to the relay.
	onConflict := `DO NOTHING`
	if n == 0 {
		var lsn string
		err := q.QueryRow(ctx, S(`SELECT lsn::text FROM pg_create_logical_replication_slot($1::text, 'pgoutput')`, slot), &lsn)
		if err != nil && !isDuplicateObject(err) { // a concurrent switch created it: register it below
			return "", fmt.Errorf("creating replication slot %q (wal_level must be logical): %w", slot, err)
		}
		onConflict = `(slot) DO UPDATE SET boundary_lsn = EXCLUDED.boundary_lsn, boundary_snap = EXCLUDED.boundary_snap, registered_at = now()`
	}
	if _, err := q.Exec(ctx, S(`INSERT INTO millwright_outbox_capture_slots (slot, boundary_lsn, boundary_snap)
    SELECT $1::text, pg_current_wal_insert_lsn(), pg_current_snapshot()
    WHERE EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1::text)
    ON CONFLICT `+onConflict, slot)); err != nil {
		return "", fmt.Errorf("registering replication slot %q%s: %w", slot, Hint(err), err)
	}
	var lsn string
	err := q.QueryRow(ctx, S(`SELECT boundary_lsn::text FROM millwright_outbox_capture_slots WHERE slot = $1::text`, slot), &lsn)
	if IsNoRows(err) {
		return "", fmt.Errorf("replication slot %q was dropped while it was being registered: run the switch again", slot)
	}
	return lsn, err
}

func isDuplicateObject(err error) bool { return Code(err) == "42710" }

// DropCaptureSlot drops the slot if it exists and no connector holds it,
// and its registration. A slot nobody reads retains WAL without bound:
// drop it when its connector is gone for good.
func DropCaptureSlot(ctx context.Context, q Querier, slot string) error {
	if _, err := q.Exec(ctx, S(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1::text`, slot)); err != nil {
		return err
	}
	_, err := q.Exec(ctx, S(`DELETE FROM millwright_outbox_capture_slots WHERE slot = $1::text`, slot))
	return err
}

// CaptureState is what a switch between the relay and Debezium looks at.
type CaptureState struct {
	WALLevel    string
	Trigger     bool // the capture trigger exists
	Publication bool // the named publication exists
	SlotExists  bool
	SlotActive  bool   // a connector streams from the slot
	Confirmed   string // the slot's confirmed_flush_lsn
	Registered  bool   // the slot has a boundary
	BoundaryLSN string
	// Registrations is every registered slot (of this outbox).
	Registrations []string
}

// ReadCaptureState reads the state of capture for slot and publication.
func ReadCaptureState(ctx context.Context, q Querier, slot, publication string) (CaptureState, error) {
	var c CaptureState
	err := q.QueryRow(ctx, S(`SELECT current_setting('wal_level'),
    EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'millwright_outbox'::regclass AND tgname = 'millwright_outbox_capture'),
    EXISTS (SELECT FROM pg_publication WHERE pubname = $2::text),
    EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1::text),
    coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1::text), false),
    coalesce((SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1::text), ''),
    EXISTS (SELECT FROM millwright_outbox_capture_slots WHERE slot = $1::text),
    coalesce((SELECT boundary_lsn::text FROM millwright_outbox_capture_slots WHERE slot = $1::text), ''),
    coalesce((SELECT array_agg(slot ORDER BY slot) FROM millwright_outbox_capture_slots), '{}')`, slot, publication),
		&c.WALLevel, &c.Trigger, &c.Publication, &c.SlotExists, &c.SlotActive, &c.Confirmed, &c.Registered, &c.BoundaryLSN, Array(&c.Registrations))
	return c, err
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

// insertedIn is the predicate of an outbox row o whose INSERT committed in
// snapshot snap (not its last UPDATE: xmin would name the relay's retry
// count or retry-failed's reset). insert_xid is NULL for a row inserted
// while the capture trigger did not exist: before any registered boundary,
// so in every snapshot a switch compares it with.
func insertedIn(snap string) string {
	return `(o.insert_xid IS NULL OR pg_visible_in_snapshot(o.insert_xid, ` + snap + `))`
}

// CountPendingBefore counts the pending rows inserted before mark id's
// snapshot that the relay has not published yet.
func CountPendingBefore(ctx context.Context, q Querier, mark int64) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM millwright_outbox o, millwright_outbox_capture_marks m
    WHERE m.id = $1 AND o.status = 'pending' AND `+insertedIn("m.snap"), mark), &n)
	return n, err
}

// CountPendingBeforeSlot counts the pending rows slot will never stream:
// those its boundary sees inserted. On the way to Debezium the relays keep
// running until this is 0.
func CountPendingBeforeSlot(ctx context.Context, q Querier, slot string) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM millwright_outbox o, millwright_outbox_capture_slots c
    WHERE c.slot = $1::text AND o.status = 'pending' AND `+insertedIn("c.boundary_snap"), slot), &n)
	return n, err
}

// markCapturedSQL picks the newest mark slot has confirmed (taken at or
// after its boundary) and marks published, in the same statement, the
// pending rows that mark sees inserted and the boundary does not. A mark
// taken before the boundary (a tracker of an earlier capture still
// running) sees nothing the boundary does not: it marks no row.
const markCapturedSQL = `WITH m AS (
    SELECT m.id, m.snap FROM millwright_outbox_capture_marks m, pg_replication_slots s, millwright_outbox_capture_slots c
    WHERE s.slot_name = $1::text AND c.slot = $1::text AND m.lsn <= s.confirmed_flush_lsn AND m.lsn >= c.boundary_lsn
    ORDER BY m.id DESC LIMIT 1
), u AS (
    UPDATE millwright_outbox o SET status = 'published', published_at = now()
    FROM m, millwright_outbox_capture_slots c
    WHERE c.slot = $1::text AND o.status = 'pending' AND o.insert_xid IS NOT NULL
        AND pg_visible_in_snapshot(o.insert_xid, m.snap) AND NOT pg_visible_in_snapshot(o.insert_xid, c.boundary_snap)
    RETURNING 1
)
SELECT coalesce((SELECT id FROM m), 0), (SELECT count(*) FROM u), EXISTS (SELECT FROM millwright_outbox_capture_slots WHERE slot = $1::text)`

// MarkCaptured marks published the pending rows slot's connector has
// delivered: those inserted after the slot's boundary and before the
// newest capture mark at or before the slot's confirmed_flush_lsn. Older
// marks are deleted. It returns the rows marked and the mark used (0: none
// is confirmed yet); ErrSlotNotRegistered for a slot no switch registered.
func MarkCaptured(ctx context.Context, q Querier, slot string) (rows int64, mark int64, err error) {
	var registered bool
	if err = q.QueryRow(ctx, S(markCapturedSQL, slot), &mark, &rows, &registered); err != nil {
		return 0, 0, fmt.Errorf("marking captured rows published: %w", err)
	}
	if !registered {
		return 0, 0, fmt.Errorf("slot %q: %w: run `millwright outbox switch-to-debezium --slot %s` (capture.SwitchToDebezium) first", slot, ErrSlotNotRegistered, slot)
	}
	if mark == 0 {
		return 0, 0, nil
	}
	_, err = q.Exec(ctx, S(`DELETE FROM millwright_outbox_capture_marks WHERE id < $1`, mark))
	return rows, mark, err
}

// CheckCaptureOff returns an error wrapping ErrCaptureActive, naming the
// slot or the trigger, while capture is on: a slot is registered or the
// capture trigger exists. what names the refused change.
func CheckCaptureOff(ctx context.Context, q Querier, what string) error {
	var slots []string
	var trigger bool
	if err := q.QueryRow(ctx, S(`SELECT coalesce((SELECT array_agg(slot ORDER BY slot) FROM millwright_outbox_capture_slots), '{}'),
    EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'millwright_outbox'::regclass AND tgname = 'millwright_outbox_capture')`), Array(&slots), &trigger); err != nil {
		return fmt.Errorf("checking for Debezium capture%s: %w", Hint(err), err)
	}
	if len(slots) == 0 && !trigger {
		return nil
	}
	on := "the capture trigger millwright_outbox_capture exists"
	fix := "finish the way back with `millwright outbox switch-to-relay --slot <slot> --publication <publication>`"
	if len(slots) > 0 {
		on = fmt.Sprintf("replication slot %q is registered", slots[0])
		fix = fmt.Sprintf("stop the connector, switch back with `millwright outbox switch-to-relay --slot %s --publication <publication>`", slots[0])
	}
	return fmt.Errorf("%s refused: %w (%s): its publication streams inserts only, so a row changed back to pending would never be sent by the connector; %s, then run it again", what, ErrCaptureActive, on, fix)
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

// TruncateOutbox empties the outbox: `millwright-bench debezium` between
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
