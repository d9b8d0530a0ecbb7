package storagetest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("capture", exerciseCapture) }

func exerciseCapture(t *testing.T, setup func(t *testing.T) Setup) {
	t.Run("WireColumns", func(t *testing.T) { t.Parallel(); captureWireColumns(t, setup(t)) })
	t.Run("MarksAndSlot", func(t *testing.T) { t.Parallel(); captureMarksAndSlot(t, setup(t)) })
}

// The trigger fills the wire columns only while capture is on.
func captureWireColumns(t *testing.T, s Setup) {
	ctx := context.Background()
	p, pub := s.Pool, "pub_"+s.Schema.Name
	t.Cleanup(func() { _ = storage.DisableCapture(context.Background(), p, pub) })
	insertEvents(t, p, "off", 1)
	require.NoError(t, storage.EnableCapture(ctx, p, pub))
	require.NoError(t, storage.EnableCapture(ctx, p, pub), "idempotent")
	require.NoError(t, storage.InsertEvents(ctx, p, []storage.EventRow{
		{EventID: "e-1", Topic: "t", AggregateType: "acct", AggregateID: "a", EventType: "x", Payload: []byte(`{"k": 1}`), IsJSON: true, Metadata: `{"ce_source":"/s"}`},
		{EventID: "e-2", Topic: "t", AggregateID: "b", Payload: []byte{0, 0xff}},
	}))
	var key, headers string
	var payload []byte
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT wire_key, wire_headers::text, wire_payload FROM millwright_outbox WHERE event_id = 'e-1'`), &key, &headers, &payload))
	require.Equal(t, "acct/a", key)
	require.Equal(t, `{"k": 1}`, string(payload))
	require.Contains(t, headers, `"ce_source": "/s"`)
	require.Contains(t, headers, `"content-type": "application/json"`)
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT wire_key, wire_payload FROM millwright_outbox WHERE event_id = 'e-2'`), &key, &payload))
	require.Equal(t, "b", key)
	require.Equal(t, []byte{0, 0xff}, payload)
	var off int64
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE wire_headers IS NULL`), &off))
	require.EqualValues(t, 1, off, "the row written before capture has no wire columns")
	require.NoError(t, storage.DisableCapture(ctx, p, pub))
	insertEvents(t, p, "off2", 1)
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE wire_headers IS NULL`), &off))
	require.EqualValues(t, 2, off, "capture off: no wire columns")
}

// A mark sees the rows committed before it; MarkCaptured uses only a mark
// the slot has confirmed (a fresh slot has confirmed none taken after its
// creation); ReadSlotLag lists the slot.
func captureMarksAndSlot(t *testing.T, s Setup) {
	ctx := context.Background()
	p, slot := s.Pool, "slot_"+s.Schema.Name+"_"+s.Driver
	t.Cleanup(func() { _ = storage.DropCaptureSlot(context.Background(), p, slot) })
	insertEvents(t, p, "a", 3)
	m, err := storage.TakeCaptureMark(ctx, p)
	require.NoError(t, err)
	insertEvents(t, p, "b", 2)
	n, err := storage.CountPendingBefore(ctx, p, m.ID)
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "the mark sees the rows committed before it only")

	marked, mark, err := storage.MarkCaptured(ctx, p, slot)
	require.NoError(t, err)
	require.Zero(t, marked+mark, "no slot: nothing confirmed")
	_, err = storage.CreateCaptureSlot(ctx, p, slot)
	require.NoError(t, err)
	marked, mark, err = storage.MarkCaptured(ctx, p, slot)
	require.NoError(t, err)
	require.Zero(t, marked+mark, "creating the slot dropped the older marks: the connector never saw their rows")
	m, err = storage.TakeCaptureMark(ctx, p)
	require.NoError(t, err)
	marked, mark, err = storage.MarkCaptured(ctx, p, slot)
	require.NoError(t, err)
	require.Zero(t, marked+mark, "the slot confirmed nothing past the mark yet")
	lags, err := storage.ReadSlotLag(ctx, p)
	require.NoError(t, err)
	var found bool
	for _, l := range lags {
		if l.Slot == slot {
			found = true
			require.False(t, l.Active)
			require.GreaterOrEqual(t, l.Retained, int64(0))
		}
	}
	require.True(t, found, "slot %s in %v", slot, lags)

	// A slot confirming past the mark (advanced by hand, as a connector's
	// confirmation does) lets MarkCaptured mark the mark's rows, not later ones.
	_, err = p.Exec(ctx, storage.S(`SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot))
	require.NoError(t, err)
	m2, err := storage.TakeCaptureMark(ctx, p)
	require.NoError(t, err)
	// m at the start of the WAL, m2 far past anything the slot confirmed.
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_outbox_capture_marks SET lsn = CASE id WHEN $1 THEN '0/1'::pg_lsn ELSE 'FFFF/0'::pg_lsn END`, m.ID))
	require.NoError(t, err)
	marked, mark, err = storage.MarkCaptured(ctx, p, slot)
	require.NoError(t, err)
	require.Equal(t, m.ID, mark, "the newest confirmed mark (%d is not)", m2.ID)
	require.EqualValues(t, 5, marked, "every row committed before the mark")
	insertEvents(t, p, "c", 2)
	n, err = storage.CountPendingBefore(ctx, p, m2.ID)
	require.NoError(t, err)
	require.Zero(t, n)
	var pending int64
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE status = 'pending'`), &pending))
	require.EqualValues(t, 2, pending, "the rows after the mark stay pending")
}
