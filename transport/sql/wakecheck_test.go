package sql_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"testing"
	"time"

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

	b.publish(t, "after the kill")
	require.Equal(t, "after the kill", b.receive(t, receiveLimit))
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
	proxy.Blackhole()
	// The LISTEN and the lock's session, both ends of each.
	require.GreaterOrEqual(t, proxy.Blackholed(), int64(4), "the wake-up connections were not blackholed")

	b.publish(t, "silenced")
	require.Equal(t, "silenced", b.receive(t, receiveLimit))
	require.Positive(t, proxy.DroppedBytes(), "nothing was dropped: the fault did not happen")
	require.Eventually(t, func() bool { r, _, _ := sql.WakeCounts(b.tr); return r > 0 }, 10*time.Second, 5*time.Millisecond,
		"the silent LISTEN connection was not replaced")
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
