package sql_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/transport/sql"
)

// The wake-up connections are watched (Config.WakeCheckInterval): a lost
// one is found and replaced, and the rows it did not wake for are read,
// within about twice the interval, not at the poll. Each test sets a
// one-minute poll and waits for the row at most receiveLimit (40 s): a
// row that comes came by the fix.

// checkInterval is the tests' WakeCheckInterval.
const checkInterval = 200 * time.Millisecond

// wakeLockHolder returns the pid of the session holding the topic table's
// wake-up lock exclusively (0: none).
func wakeLockHolder(t *testing.T, db *stdsql.DB, oid uint32) int {
	var pid int
	err := db.QueryRow(`SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock'
		AND granted AND classid = $1 AND objid = $2 AND objsubid = 2`, storage.SQLWakeLockClass, oid).Scan(&pid)
	if errors.Is(err, stdsql.ErrNoRows) {
		return 0
	}
	require.NoError(t, err)
	return pid
}

// The server ends the session holding the wake-up lock while the
// subscriber waits (pg_terminate_backend of exactly that backend, as
// idle_session_timeout or a pooler dropping an idle connection would):
// the lock goes with it and writers stop notifying, while the LISTEN is
// healthy. The check finds the session gone, the subscriber queries and
// takes the lock again, and a row committed after the kill arrives.
func TestWakeLockRetakenWhenTheServerEndsItsSession(t *testing.T) {
	t.Parallel()
	b := setupNotifyWith(t, func(cfg *sql.Config) {
		cfg.PollInterval = longPoll
		cfg.WakeCheckInterval = checkInterval
	})
	oid := tableOID(t, b.schema.DB, b.topic)
	pid := wakeLockHolder(t, b.schema.DB, oid)
	require.NotZero(t, pid, "the idle subscriber holds no wake-up lock")
	var terminated bool
	require.NoError(t, b.schema.DB.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&terminated))
	require.True(t, terminated, "the lock's session %d was not terminated", pid)
	// The lock went with its session (it may be taken again already, by
	// a new one).
	require.Eventually(t, func() bool { return wakeLockHolder(t, b.schema.DB, oid) != pid }, 10*time.Second, 5*time.Millisecond,
		"the terminated session still holds the lock")

	committed := time.Now()
	b.publish(t, "after the kill")
	require.Equal(t, "after the kill", b.receive(t, receiveLimit))
	t.Logf("received %s after its commit (WakeCheckInterval %s, poll %s)", time.Since(committed).Round(time.Millisecond), checkInterval, longPoll)
	require.Positive(t, sql.LockLosses(b.tr), "the lost session was not noticed")
	// Idle again on a new session: wakes work as before.
	require.Eventually(t, func() bool { h := wakeLockHolder(t, b.schema.DB, oid); return h != 0 && h != pid }, 10*time.Second, 5*time.Millisecond,
		"the lock was not taken again")
	b.publish(t, "again")
	require.Equal(t, "again", b.receive(t, receiveLimit))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "a message came by the poll")
}

// The wake-up connections go silent (a proxy between them and the server
// drops every byte, no RST, no FIN: a dropped NAT entry, a dead
// middlebox): the LISTEN would wait for good and the lock's session, alive
// on the server, keeps the lock, so writers notify a connection that
// never delivers. The LISTEN's ping and the lock's check find them; a
// row committed after the fault arrives, and wakes work again.
func TestWakeupSurvivesSilentConnections(t *testing.T) {
	t.Parallel()
	var proxy *faultproxy.Proxy
	b := setupNotifyWith(t, func(cfg *sql.Config) {
		cfg.PollInterval = longPoll
		cfg.WakeCheckInterval = checkInterval
		p, through, err := faultproxy.Through(cfg.URL, "5432")
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		proxy, cfg.ListenURL = p, through
	})
	oid := tableOID(t, b.schema.DB, b.topic)
	silent := wakeLockHolder(t, b.schema.DB, oid)
	require.NotZero(t, silent)
	proxy.Blackhole()
	// The LISTEN and the lock's session, both ends of each.
	require.GreaterOrEqual(t, proxy.Blackholed(), int64(4), "the wake-up connections were not blackholed")

	committed := time.Now()
	b.publish(t, "silenced")
	require.Equal(t, "silenced", b.receive(t, receiveLimit))
	t.Logf("received %s after its commit (WakeCheckInterval %s, poll %s)", time.Since(committed).Round(time.Millisecond), checkInterval, longPoll)
	require.Positive(t, proxy.DroppedBytes(), "nothing was dropped: the fault did not happen")
	require.Eventually(t, func() bool { r, _, _ := sql.WakeCounts(b.tr); return r > 0 }, 10*time.Second, 5*time.Millisecond,
		"the silent LISTEN connection was not replaced")
	// The silent session, alive on the server with the lock, was ended
	// from the new connection, which holds the lock now.
	require.Eventually(t, func() bool { h := wakeLockHolder(t, b.schema.DB, oid); return h != 0 && h != silent }, 10*time.Second, 5*time.Millisecond,
		"the silent session (pid %d) still holds the lock", silent)
	require.Positive(t, sql.StaleSessionsEnded(b.tr))
	b.publish(t, "again")
	require.Equal(t, "again", b.receive(t, receiveLimit))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "a message came by the poll")
}

// WakeCheckInterval: 0 is the default, -1 disables the checks, anything
// else below 10ms is refused, naming the field.
func TestWakeCheckIntervalValidate(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{0, -1, 10 * time.Millisecond, time.Minute} {
		require.NoError(t, sql.Config{URL: "postgres://h/db", WakeCheckInterval: d}.Validate(), "%s", d)
	}
	for _, d := range []time.Duration{-2, -time.Second, time.Millisecond} {
		_, err := sql.Open(context.Background(), sql.Config{URL: "postgres://h/db", WakeCheckInterval: d}, nil)
		require.ErrorContains(t, err, "WakeCheckInterval "+d.String()+": want at least 10ms, or -1 to disable", "%s", d)
	}
}

// A subscription whose try of the wake-up lock fails (its session ended
// since the transport's last statement on it) tries again on a new
// session within a second, not at its poll: writers do not notify while
// nobody holds the lock. The checks are off, so only that retry can
// deliver; the other subscription, armed on the ended session, is woken
// when it is dropped and takes its lock again.
func TestWakeLockTriedAgainWhenTakingItFails(t *testing.T) {
	t.Parallel()
	b := setupNotifyWith(t, func(cfg *sql.Config) {
		cfg.PollInterval = longPoll
		cfg.WakeCheckInterval = -1
	})
	oid := tableOID(t, b.schema.DB, b.topic)
	pid := wakeLockHolder(t, b.schema.DB, oid)
	require.NotZero(t, pid)

	// A second subscription, on a second topic, busy with a message it
	// read without a notification (published before it subscribed: no
	// notified id is left pending to end its next wait early).
	other := &notifyBundle{schema: b.schema, tr: b.tr, topic: b.topic + ".2"}
	other.publish(t, "busy")
	sub, err := b.tr.Subscriber("g2")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	other.msgs, err = sub.Subscribe(ctx, other.topic)
	require.NoError(t, err)
	oid2 := tableOID(t, b.schema.DB, other.topic)
	busy := other.next(t)
	require.Equal(t, "busy", string(busy.Payload))

	// Its next try of the lock meets the ended session.
	var terminated atomic.Int32
	sql.SetWakeHooks(b.tr, func(table uint32) {
		if table != oid2 || terminated.Load() != 0 {
			return
		}
		var ok bool
		if assert.NoError(t, b.schema.DB.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&ok)) && assert.True(t, ok) {
			assert.Eventually(t, func() bool {
				var n int
				return assert.NoError(t, b.schema.DB.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n)) && n == 0
			}, 10*time.Second, 5*time.Millisecond, "the session did not end")
			terminated.Store(1)
		}
	}, nil)
	busy.Ack()
	// The failed try dropped the session: the first subscription takes
	// its lock again on a new one.
	require.Eventually(t, func() bool {
		h := wakeLockHolder(t, b.schema.DB, oid)
		return terminated.Load() == 1 && h != 0 && h != pid
	},
		20*time.Second, 5*time.Millisecond, "the lock's session was not terminated, or the first subscription's lock not taken again")
	sql.SetWakeHooks(b.tr, nil, nil)

	for i := range 2 {
		other.publish(t, fmt.Sprint("after ", i))
		require.Equal(t, fmt.Sprint("after ", i), other.receive(t, receiveLimit))
	}
	b.publish(t, "first")
	require.Equal(t, "first", b.receive(t, receiveLimit))
	_, _, polls := sql.WakeCounts(b.tr)
	require.Zero(t, polls, "a message came by the poll")
}
