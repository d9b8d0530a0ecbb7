package sql_test

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport/sql"
)

// longPoll is the poll interval of the wake-up tests: a message that
// arrives well within it was not fetched by the poll.
const longPoll = time.Minute

// receiveLimit bounds each wait for a message: within longPoll (so a
// message that came in time cannot have come by the poll), and long
// enough for a loaded machine and for the xmin horizon, which any
// session of the shared server (another test, package or run) can hold
// back for a while: watermill-sql reads only rows below it.
const receiveLimit = 40 * time.Second

type notifyBundle struct {
	schema *pgtest.Schema
	tr     *sql.Transport
	topic  string
	msgs   <-chan *message.Message
}

func setupNotify(t *testing.T, poll time.Duration, listenURL func(schemaURL string) string) *notifyBundle {
	t.Helper()
	return setupNotifyWith(t, func(cfg *sql.Config) {
		cfg.PollInterval = poll
		if listenURL != nil {
			cfg.ListenURL = listenURL(cfg.URL)
		}
	})
}

// setupNotifyWith is setupNotify with the transport's config set by
// configure (URL set, horizon check disabled).
func setupNotifyWith(t *testing.T, configure func(cfg *sql.Config)) *notifyBundle {
	t.Helper()
	s := pgtest.New(t)
	cfg := sql.Config{URL: s.URL, HorizonCheckInterval: -1}
	configure(&cfg)
	tr, err := sql.Open(context.Background(), cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tr.Close()) })
	b := &notifyBundle{schema: s, tr: tr, topic: fmt.Sprintf("notify.orders.%d", time.Now().UnixNano())}
	sub, err := tr.Subscriber("g")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b.msgs, err = sub.Subscribe(ctx, b.topic)
	require.NoError(t, err)
	// Idle: writers notify from now on (a wait begun after the first
	// look; the table is empty, so its look came after the lock).
	oid := tableOID(t, s.DB, b.topic)
	require.Eventually(t, func() bool { return sql.Waits(tr) > 0 && wakeLockHeld(t, s.DB, oid) }, 10*time.Second, 5*time.Millisecond,
		"the idle subscriber does not hold the wake-up lock")
	return b
}

func (b *notifyBundle) publish(t *testing.T, payload string) {
	t.Helper()
	require.NoError(t, b.tr.Publisher().Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte(payload))))
}

// receive returns the next message's payload, failing after limit.
func (b *notifyBundle) receive(t *testing.T, limit time.Duration) string {
	t.Helper()
	select {
	case m := <-b.msgs:
		m.Ack()
		return string(m.Payload)
	case <-time.After(limit):
		r, w, p := sql.WakeCounts(b.tr)
		t.Fatalf("no message within %s (reconnects %d, wakes %d, polls %d)", limit, r, w, p)
		return ""
	}
}

// A commit wakes the subscriber: with a one-minute poll, each message
// arrives within seconds, fetched on a notification, never by the poll.
func TestNotifyWakesTheSubscriber(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	for i := range 5 {
		b.publish(t, fmt.Sprint(i))
		require.Equal(t, fmt.Sprint(i), b.receive(t, receiveLimit))
	}
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "a message came by the poll")
}

// Inside a user's transaction (watermill-sql's publisher on it): nothing
// is delivered before the commit, the commit wakes the subscriber, and a
// rolled-back insert wakes nobody and delivers nothing.
func TestNotifyAtTheUsersCommit(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	publishIn := func(payload string, commit bool) {
		tx, err := b.schema.DB.Begin()
		require.NoError(t, err)
		p, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: sql.Schema()}, nil)
		require.NoError(t, err)
		require.NoError(t, p.Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte(payload))))
		if commit {
			require.NoError(t, tx.Commit())
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	publishIn("rolled back", false)
	publishIn("committed", true)
	require.Equal(t, "committed", b.receive(t, receiveLimit), "the rolled-back message was delivered")
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls)
}

// watermill-sql reads only rows below the xmin horizon: a message
// committed while an older transaction (one that does not touch the topic,
// so never notifies) still runs is invisible at its notification. It is
// not lost: it arrives once that transaction ends, within seconds, with a
// one-minute poll.
func TestNotifyWaitsForTheHorizon(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	blocker, err := b.schema.DB.Begin()
	require.NoError(t, err)
	defer blocker.Rollback() //nolint:errcheck
	var xid uint64
	require.NoError(t, blocker.QueryRow(`SELECT pg_current_xact_id()::text::bigint`).Scan(&xid))

	b.publish(t, "behind")
	// Invisible while the blocker runs: the notification came and went.
	require.Eventually(t, func() bool { _, w, _ := sql.WakeCounts(b.tr); return w > 0 }, 10*time.Second, 5*time.Millisecond)
	select {
	case m := <-b.msgs:
		t.Fatalf("delivered %q above the horizon %d", m.Payload, xid)
	case <-time.After(200 * time.Millisecond):
	}
	require.NoError(t, blocker.Commit())
	require.Equal(t, "behind", b.receive(t, receiveLimit))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "it came by the poll, not by the horizon re-check")
}

// With its LISTEN connection cut and refused (a proxy between the
// listener and the server), the subscriber falls back to its poll and
// loses nothing; once the proxy lets it through again the listener
// reconnects (bounded) and notifications wake the subscriber again.
func TestNotifyFallsBackToThePollWhenTheListenerIsCut(t *testing.T) {
	t.Parallel()
	var proxy *faultproxy.Proxy
	b := setupNotify(t, 500*time.Millisecond, func(u string) string {
		p, through, err := faultproxy.Through(u, "5432")
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		proxy = p
		return through
	})
	b.publish(t, "before")
	require.Equal(t, "before", b.receive(t, receiveLimit))

	// Until the messages below came by the poll: the outage ends when the
	// test ends it, not after a fixed 8 s, which a loaded machine's polls
	// and deliveries could outlast (the listener then reconnected before
	// the checks, and they failed on a correct fallback).
	proxy.Outage(time.Hour)
	require.Positive(t, proxy.CutConns(), "the LISTEN connection was not cut")
	// Two polls after the cut, and a wait begun after the second one's
	// query (the poll's count rises before its query runs, which could
	// still read what comes now): only the poll can fetch what comes now.
	_, _, p0 := sql.WakeCounts(b.tr)
	require.Eventually(t, func() bool { _, _, p := sql.WakeCounts(b.tr); return p >= p0+2 }, 10*time.Second, 5*time.Millisecond)
	waits := sql.Waits(b.tr)
	require.Eventually(t, func() bool { return sql.Waits(b.tr) > waits }, 10*time.Second, 5*time.Millisecond)
	_, wakes0, polls0 := sql.WakeCounts(b.tr)
	for i := range 3 {
		b.publish(t, fmt.Sprint("during ", i))
	}
	for i := range 3 {
		require.Equal(t, fmt.Sprint("during ", i), b.receive(t, receiveLimit))
	}
	reconnects, wakes, polls := sql.WakeCounts(b.tr)
	require.Zero(t, reconnects, "the listener was back before the messages: not the fallback")
	require.Equal(t, wakes0, wakes, "woken without a listener")
	require.Greater(t, polls, polls0)

	proxy.Outage(0) // the listener may reconnect now
	require.Eventually(t, func() bool { r, _, _ := sql.WakeCounts(b.tr); return r > 0 }, 40*time.Second, 20*time.Millisecond,
		"the listener did not reconnect")
	// Idle again, with the lock taken again on a new connection.
	oid := tableOID(t, b.schema.DB, b.topic)
	require.Eventually(t, func() bool { return wakeLockHeld(t, b.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond)
	_, wakes, _ = sql.WakeCounts(b.tr)
	b.publish(t, "after")
	require.Equal(t, "after", b.receive(t, receiveLimit))
	require.Eventually(t, func() bool { _, w, _ := sql.WakeCounts(b.tr); return w > wakes }, 10*time.Second, 5*time.Millisecond,
		"no wake after the reconnection")
}

// wakeLockHeld reports whether some session holds the topic table's
// wake-up lock exclusively (a subscriber waits).
func wakeLockHeld(t *testing.T, db *stdsql.DB, oid uint32) bool {
	var held bool
	require.NoError(t, db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock'
		AND granted AND classid = $1 AND objid = $2 AND objsubid = 2)`, storage.SQLWakeLockClass, oid).Scan(&held))
	return held
}

// tableOID returns the oid of topic's table, which the notifications name.
func tableOID(t *testing.T, db *stdsql.DB, topic string) uint32 {
	oid, err := storage.TableOID(context.Background(), storage.NewSQL(db), `"watermill_`+topic+`"`)
	require.NoError(t, err)
	return oid
}

// publishID publishes payload and returns its transaction id.
func (b *notifyBundle) publishID(t *testing.T, payload string) uint64 {
	t.Helper()
	id := watermill.NewUUID()
	require.NoError(t, b.tr.Publisher().Publish(b.topic, message.NewMessage(id, []byte(payload))))
	var xid uint64
	require.NoError(t, b.schema.DB.QueryRow(`SELECT transaction_id::text::bigint FROM `+`"watermill_`+b.topic+`"`+
		` WHERE uuid = $1`, id).Scan(&xid))
	return xid
}

// tableListener LISTENs on the wake-up channel on a connection of its
// own and hands over the transaction ids notified for table.
func tableListener(t *testing.T, url string, table uint32) <-chan uint64 {
	ctx, cancel := context.WithCancel(context.Background())
	l, err := storage.NewListener(ctx, storage.DriverSQL, storage.ListenerConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { cancel(); _ = l.Close() })
	require.NoError(t, l.Listen(ctx, storage.SQLNotifyChannel))
	out := make(chan uint64, 100)
	go func() {
		for n := range l.Notifications() {
			if n == nil {
				continue
			}
			if tb, xid, ok := storage.ParseSQLNotification(n.Payload); ok && tb == table {
				out <- xid
			}
		}
	}()
	return out
}

// Writers notify only while a subscriber waits: a commit while the only
// subscriber is busy with a message (unacked) notifies nobody, one while
// it waits is notified and wakes it (one-minute poll). Notifications come
// in commit order, so the busy commit's would come before the next one.
func TestNotifyOnlyWhileTheSubscriberWaits(t *testing.T) {
	t.Parallel()
	b := setupNotify(t, longPoll, nil)
	oid := tableOID(t, b.schema.DB, b.topic)
	notified := tableListener(t, b.schema.URL, oid)
	require.Eventually(t, func() bool { return wakeLockHeld(t, b.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond,
		"the idle subscriber does not hold the wake-up lock")

	nextNotified := func() uint64 {
		select {
		case x := <-notified:
			return x
		case <-time.After(10 * time.Second):
			r, w, p := sql.WakeCounts(b.tr)
			t.Fatalf("no notification within 10s (lock held %v, waits %d, reconnects %d, wakes %d, polls %d)",
				wakeLockHeld(t, b.schema.DB, oid), sql.Waits(b.tr), r, w, p)
			return 0
		}
	}
	idle := b.publishID(t, "idle")
	require.Equal(t, idle, nextNotified())
	var m *message.Message
	select {
	case m = <-b.msgs:
	case <-time.After(10 * time.Second):
		t.Fatal("the notification did not wake the subscriber")
	}
	require.Equal(t, "idle", string(m.Payload))
	require.Eventually(t, func() bool { return !wakeLockHeld(t, b.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond,
		"the busy subscriber keeps the wake-up lock")
	busy := b.publishID(t, "busy")
	waits := sql.Waits(b.tr)
	m.Ack()
	require.Equal(t, "busy", b.receive(t, 10*time.Second))

	// Waiting again: a wait begun after the lock was taken again.
	require.Eventually(t, func() bool { return wakeLockHeld(t, b.schema.DB, oid) && sql.Waits(b.tr) > waits }, 10*time.Second, 5*time.Millisecond,
		"the subscriber, idle again, does not take the wake-up lock")
	again := b.publishID(t, "idle again")
	got := nextNotified()
	require.NotEqual(t, busy, got, "the commit while the subscriber was busy notified")
	require.Equal(t, again, got)
	require.Equal(t, "idle again", b.receive(t, 10*time.Second))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "a message came by the poll")
}

// Two processes (transports) consume one table in their own groups: one
// holds the wake-up lock, the other relies on it (its notifications go to
// every listener); both wake within seconds with a one-minute poll, also
// after the holder's subscription ends (its handover).
func TestNotifyWakesEveryProcessOfATable(t *testing.T) {
	t.Parallel()
	a := setupNotify(t, longPoll, nil)
	tr, err := sql.Open(context.Background(), sql.Config{URL: a.schema.URL, PollInterval: longPoll, HorizonCheckInterval: -1}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tr.Close()) })
	sub, err := tr.Subscriber("other")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b := &notifyBundle{schema: a.schema, tr: tr, topic: a.topic}
	b.msgs, err = sub.Subscribe(ctx, a.topic)
	require.NoError(t, err)
	oid := tableOID(t, a.schema.DB, a.topic)
	for i := range 3 {
		require.Eventually(t, func() bool { return wakeLockHeld(t, a.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond)
		a.publish(t, fmt.Sprint(i))
		require.Equal(t, fmt.Sprint(i), a.receive(t, 10*time.Second))
		require.Equal(t, fmt.Sprint(i), b.receive(t, 10*time.Second))
	}
	require.NoError(t, a.tr.Close()) // whichever held it, b now does or relies on nobody
	require.Eventually(t, func() bool { return wakeLockHeld(t, a.schema.DB, oid) }, 10*time.Second, 5*time.Millisecond)
	b.publish(t, "after")
	require.Equal(t, "after", b.receive(t, 10*time.Second))
	for _, tr := range []*sql.Transport{a.tr, b.tr} {
		_, _, polls := sql.WakeCounts(tr)
		require.Zero(t, polls, "a message came by the poll")
	}
}
