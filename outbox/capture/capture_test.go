package capture_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/capture"
	"github.com/millwright/millwright/postgres"
)

// slotWAL reads MetricSlotRetainedWAL for slot from reg (-1: no sample).
func slotWAL(t *testing.T, reg *prometheus.Registry, slot string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != capture.MetricSlotRetainedWAL {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "slot" && l.GetValue() == slot {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}

// A slot nobody reads retains the WAL written after it, and the tracker's
// gauge shows it growing; rows stay pending while the slot confirms
// nothing. Needs wal_level=logical (scripts/services.sh sets it).
func TestCaptureTrackerExportsSlotWAL(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, err := storage.From(s.DB)
	require.NoError(t, err)
	slot := "wal_" + s.Name
	require.NoError(t, capture.Enable(ctx, postgres.From(s.DB), slot))
	t.Cleanup(func() {
		_ = storage.DropCaptureSlot(context.Background(), q, slot)
		_ = capture.Disable(context.Background(), postgres.From(s.DB), slot)
	})
	_, err = storage.CreateCaptureSlot(ctx, q, slot)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	tr, err := capture.NewTracker(postgres.From(s.DB), capture.Config{Slot: slot, Registerer: reg})
	require.NoError(t, err)
	_, err = tr.RunOnce(ctx)
	require.NoError(t, err)
	before := slotWAL(t, reg, slot)
	require.GreaterOrEqual(t, before, 0.0, "no sample for slot %s", slot)

	evs := make([]outbox.Event, 500)
	for i := range evs {
		evs[i] = outbox.Event{Topic: "t", AggregateID: fmt.Sprintf("a-%d", i), Payload: []byte(`{"pad":"` + fmt.Sprint(i) + `"}`)}
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), evs...))
	r, err := tr.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, r.Marked, "the slot confirmed nothing: no row is delivered")
	after := slotWAL(t, reg, slot)
	require.Greater(t, after, before+float64(len(evs))*100, "500 events' WAL is retained by the slot")
	st, err := outbox.ReadStats(ctx, postgres.From(s.DB))
	require.NoError(t, err)
	require.EqualValues(t, len(evs), st.Pending)

	_, err = capture.NewTracker(postgres.From(s.DB), capture.Config{})
	require.ErrorContains(t, err, "capture.Config.Slot is empty")
}

// Every write path records the inserting transaction while capture is on
// (the capture trigger sets insert_xid): Add in a database/sql
// transaction, Add in a pgx transaction, AddToBatch, and Add inside a
// savepoint (whose row's xmin is the subtransaction's, not the one a
// snapshot lists). The capture tracker and the switch judge rows by it.
func TestCaptureRecordsTheInsertingTransactionOnEveryPath(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pub := "ix_" + s.Name
	require.NoError(t, capture.Enable(ctx, postgres.From(s.DB), pub))
	t.Cleanup(func() { _ = capture.Disable(context.Background(), postgres.From(s.DB), pub) })
	ev := func(id string) outbox.Event {
		return outbox.Event{ID: id, Topic: "t", AggregateID: "a", Payload: []byte(`{}`)}
	}
	want := map[string]string{}

	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	var xid string
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), ev("pq")))
	_, err = tx.ExecContext(ctx, `SAVEPOINT sp`)
	require.NoError(t, err)
	require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), ev("pq-savepoint")))
	_, err = tx.ExecContext(ctx, `RELEASE SAVEPOINT sp`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	want["pq"], want["pq-savepoint"] = xid, xid

	pool := s.Pgx(t)
	ptx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, ptx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))
	require.NoError(t, outbox.Add(ctx, postgres.PgxTx(ptx), ev("pgx")))
	b := &pgx.Batch{}
	require.NoError(t, outbox.AddToBatch(ctx, b, ev("batch")))
	require.NoError(t, ptx.SendBatch(ctx, b).Close())
	require.NoError(t, ptx.Commit(ctx))
	want["pgx"], want["batch"] = xid, xid

	got := map[string]string{}
	rows, err := s.DB.QueryContext(ctx, `SELECT event_id, coalesce(insert_xid::text, 'NULL'), xmin::text FROM millwright_outbox`)
	require.NoError(t, err)
	defer rows.Close()
	var xmins []string
	for rows.Next() {
		var id, ix, xmin string
		require.NoError(t, rows.Scan(&id, &ix, &xmin))
		got[id] = ix
		if id == "pq-savepoint" {
			xmins = append(xmins, xmin)
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, want, got)
	require.NotEqual(t, want["pq-savepoint"], xmins[0], "the savepoint's row has the subtransaction's xmin")
}
