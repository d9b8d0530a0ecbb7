package sql_test

import (
	"context"
	stdsql "database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/transport/sql"
)

// The interleavings of the wake-up lock (doc.go's argument), each
// provoked by the consume loop's hooks rather than by chance.

// next returns the next message unacked, failing after 10s.
func (b *notifyBundle) next(t *testing.T) *message.Message {
	t.Helper()
	select {
	case m := <-b.msgs:
		return m
	case <-time.After(10 * time.Second):
		r, w, p := sql.WakeCounts(b.tr)
		t.Fatalf("no message within 10s (reconnects %d, wakes %d, polls %d)", r, w, p)
		return nil
	}
}

// idleAgain waits for the subscriber to wait again with the lock held, a
// wait begun after waits.
func (b *notifyBundle) idleAgain(t *testing.T, oid uint32, waits int64) {
	t.Helper()
	require.Eventually(t, func() bool { return sql.Waits(b.tr) > waits && wakeLockHeld(t, b.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond,
		"the subscriber, idle again, does not hold the wake-up lock")
}

// kick publishes a message and returns it unacked once delivered: its
// ack sends the loop, after one more (empty) query, to the lock.
func (b *notifyBundle) kick(t *testing.T) *message.Message {
	t.Helper()
	b.publish(t, "kick")
	m := b.next(t)
	require.Equal(t, "kick", string(m.Payload))
	return m
}

// beginXid begins a transaction with a transaction id (it holds the xmin
// horizon back until it ends).
func beginXid(t *testing.T, b *notifyBundle) (*stdsql.Tx, uint64) {
	t.Helper()
	tx, err := b.schema.DB.Begin()
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	var xid uint64
	require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id()::text::bigint`).Scan(&xid))
	return tx, xid
}

// insertIn publishes payload on topic in tx (watermill-sql's publisher
// on it); hooks call it, on the consume loop's goroutine.
func insertIn(tx *stdsql.Tx, topic, payload string) error {
	p, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: sql.Schema()}, nil)
	if err != nil {
		return err
	}
	return p.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(payload)))
}

// A row the horizon hid at the wake but that the look under the lock
// reads is handed over with the lock given back: writers do not notify
// while the subscriber is busy with it. (The reverted version looked with
// watermill-sql's own query, which handed the row over with the lock
// held until the ack.) Then, idle again, the subscriber holds the lock
// and a commit is notified: the notification of the row it read is not
// left pending to end that wait at once.
func TestWakeLockReleasedWhenTheLookFindsARow(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	oid := tableOID(t, b.schema.DB, b.topic)
	notified := tableListener(t, b.schema.URL, oid)

	blocker, _ := beginXid(t, b) // hides what is published now
	var looks atomic.Int32
	sql.SetWakeHooks(b.tr, nil, func(table uint32) {
		if table == oid && looks.Add(1) == 1 {
			assert.NoError(t, blocker.Commit()) // visible from the look on
		}
	})
	xid := b.publishID(t, "hidden at the wake")
	select {
	case x := <-notified:
		require.Equal(t, xid, x)
	case <-time.After(10 * time.Second):
		t.Fatal("the commit while the subscriber waited did not notify")
	}
	m := b.next(t)
	require.Equal(t, "hidden at the wake", string(m.Payload))
	require.Positive(t, looks.Load(), "the row was not read by the look after the wake")
	require.False(t, wakeLockHeld(t, b.schema.DB, oid), "the lock is held while the subscriber is busy")
	sql.SetWakeHooks(b.tr, nil, nil)

	waits := sql.Waits(b.tr)
	m.Ack()
	b.idleAgain(t, oid, waits)
	again := b.publishID(t, "idle again")
	select {
	case x := <-notified:
		require.Equal(t, again, x)
	case <-time.After(10 * time.Second):
		t.Fatalf("no notification while idle (lock held %v)", wakeLockHeld(t, b.schema.DB, oid))
	}
	require.Equal(t, "idle again", b.receive(t, 10*time.Second))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls)
}

// A writer that inserted before the lock holds it shared: the loop
// cannot take it, queries again, and takes it once the writer has
// committed; its look then reads the row, which never notified.
func TestWakeLockWaitsForWritersInTheirTransaction(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	oid := tableOID(t, b.schema.DB, b.topic)
	kick := b.kick(t)

	writer, err := b.schema.DB.Begin()
	require.NoError(t, err)
	t.Cleanup(func() { _ = writer.Rollback() })
	var tries atomic.Int32
	sql.SetWakeHooks(b.tr, func(table uint32) {
		if table != oid {
			return
		}
		switch tries.Add(1) {
		case 1: // inserted, not committed: its trigger took the lock shared
			assert.NoError(t, insertIn(writer, b.topic, "in its transaction"))
		case 2: // the loop found the lock shared and queried again
			assert.NoError(t, writer.Commit())
		}
	}, nil)
	kick.Ack()
	require.Equal(t, "in its transaction", b.receive(t, 10*time.Second))
	require.GreaterOrEqual(t, tries.Load(), int32(2), "the lock was taken with the writer in its transaction")
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls)
}

// A writer that committed before the lock, its row hidden by an older
// transaction, did not notify: the look finds no row to read but the
// hidden one, and the loop waits for the horizon to pass it (a
// one-minute poll).
func TestWakeLockWaitsForAHiddenRowThatDidNotNotify(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	oid := tableOID(t, b.schema.DB, b.topic)
	notified := tableListener(t, b.schema.URL, oid)
	kick := b.kick(t)
	blocker, _ := beginXid(t, b)
	var hidden atomic.Uint64
	var tries atomic.Int32
	sql.SetWakeHooks(b.tr, func(table uint32) {
		if table == oid && tries.Add(1) == 1 {
			assert.False(t, wakeLockHeld(t, b.schema.DB, oid), "the lock is held: the writer would notify")
			writer, err := b.schema.DB.Begin()
			if !assert.NoError(t, err) {
				return
			}
			var xid uint64
			assert.NoError(t, insertIn(writer, b.topic, "hidden, not notified"))
			assert.NoError(t, writer.QueryRow(`SELECT pg_current_xact_id()::text::bigint`).Scan(&xid))
			assert.NoError(t, writer.Commit())
			hidden.Store(xid)
		}
	}, nil)
	waits := sql.Waits(b.tr)
	kick.Ack()
	b.idleAgain(t, oid, waits) // looked: nothing to read yet
	select {
	case m := <-b.msgs:
		t.Fatalf("delivered %q above the horizon", m.Payload)
	default:
	}
	require.NoError(t, blocker.Commit())
	require.Equal(t, "hidden, not notified", b.receive(t, 10*time.Second))
	for len(notified) > 0 {
		require.NotEqual(t, hidden.Load(), <-notified, "the writer notified: the interleaving was not provoked")
	}
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls)
}

// A transport that stops (Close stops its listener after its
// subscriptions, whose disarm may come later) gives the lock back with
// its handover, so that another process relying on its hold takes it at
// once. (The reverted version closed the lock connection: the server
// released the lock silently.)
func TestWakeLockHandedOverWhenTheTransportStops(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	oid := tableOID(t, b.schema.DB, b.topic)
	handovers := handoverListener(t, b.schema.URL, oid)
	sql.StopWakeups(b.tr)
	select {
	case <-handovers:
	case <-time.After(10 * time.Second):
		t.Fatal("no handover when the holder stopped")
	}
	require.False(t, wakeLockHeld(t, b.schema.DB, oid))
}

// handoverListener LISTENs on the wake-up channel and signals each
// handover of table.
func handoverListener(t *testing.T, url string, table uint32) <-chan struct{} {
	ctx, cancel := context.WithCancel(context.Background())
	l, err := storage.NewListener(ctx, storage.DriverSQL, storage.ListenerConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { cancel(); _ = l.Close() })
	require.NoError(t, l.Listen(ctx, storage.SQLNotifyChannel))
	out := make(chan struct{}, 100)
	go func() {
		for n := range l.Notifications() {
			if n == nil {
				continue
			}
			if tb, _, ok := storage.ParseSQLHandover(n.Payload); ok && tb == table {
				out <- struct{}{}
			}
		}
	}()
	return out
}
