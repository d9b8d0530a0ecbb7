package storagetest

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/faultproxy"
)

func init() { Register("sqlnotify", exerciseSQLNotify) }

// exerciseSQLNotify checks the sql transport's wake-up operations: the
// trigger statements (idempotent), the oid and horizon reads, and the
// payload the trigger sends.
func exerciseSQLNotify(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()

	t.Run("TriggerNotifiesTheTableAndTransaction", func(t *testing.T) {
		t.Parallel()
		s := setup(t)
		p := s.Pool
		_, err := p.Exec(ctx, storage.S(`CREATE TABLE "watermill_n" ("offset" BIGSERIAL, transaction_id xid8 NOT NULL)`))
		require.NoError(t, err)
		for range 2 { // idempotent
			for _, q := range storage.SQLNotifySchemaStatements(`"watermill_n"`) {
				_, err := p.Exec(ctx, storage.S(q))
				require.NoError(t, err)
			}
		}
		var triggers int
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM pg_trigger WHERE tgrelid = '"watermill_n"'::regclass AND tgname = 'millwright_notify'`), &triggers))
		require.Equal(t, 1, triggers)
		oid, err := storage.TableOID(ctx, p, `"watermill_n"`)
		require.NoError(t, err)

		// What a listener receives at the commit: the table's oid and the
		// inserting transaction's id, once for two rows; only while a
		// consumer holds the table's wake-up lock exclusively (notifications
		// come in commit order: one of the insert before would come first).
		l, err := storage.NewListener(ctx, storage.DriverSQL, storage.ListenerConfig{URL: s.Schema.URL})
		require.NoError(t, err)
		defer l.Close()
		require.NoError(t, l.Listen(ctx, storage.SQLNotifyChannel))
		_, err = p.Exec(ctx, storage.S(`INSERT INTO "watermill_n" (transaction_id) VALUES (pg_current_xact_id())`))
		require.NoError(t, err)
		holder, err := p.Begin(ctx, storage.TxOptions{})
		require.NoError(t, err)
		defer holder.Rollback(ctx) //nolint:errcheck
		_, err = holder.Exec(ctx, storage.S(`SELECT pg_advisory_xact_lock($1, $2::oid::int4)`, storage.SQLWakeLockClass, oid))
		require.NoError(t, err)
		tx, err := p.Begin(ctx, storage.TxOptions{})
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = tx.Exec(ctx, storage.S(`INSERT INTO "watermill_n" (transaction_id) VALUES (pg_current_xact_id()), (pg_current_xact_id())`))
		require.NoError(t, err)
		var xid uint64
		require.NoError(t, tx.QueryRow(ctx, storage.S(`SELECT pg_current_xact_id()::text::bigint`), &xid))
		h, err := storage.SnapshotXmin(ctx, tx)
		require.NoError(t, err)
		require.LessOrEqual(t, h, xid, "a running transaction is at or above the horizon")
		require.NoError(t, tx.Commit(ctx))
		got := 0
		timeout := time.After(10 * time.Second)
		for got == 0 {
			select {
			case n := <-l.Notifications():
				if n == nil {
					continue
				}
				table, x, ok := storage.ParseSQLNotification(n.Payload)
				if ok && table == oid {
					require.Equal(t, xid, x)
					got++
				}
			case <-timeout:
				t.Fatal("no notification within 10s of the commit")
			}
		}
	})

	t.Run("LookUnderTheWakeLock", func(t *testing.T) {
		t.Parallel()
		p := setup(t).Pool
		_, err := p.Exec(ctx, storage.S(`CREATE TABLE "watermill_l" ("offset" BIGSERIAL, transaction_id xid8 NOT NULL)`))
		require.NoError(t, err)
		_, err = p.Exec(ctx, storage.S(`CREATE TABLE "watermill_offsets_l" (consumer_group TEXT PRIMARY KEY, offset_acked BIGINT, last_processed_transaction_id xid8)`))
		require.NoError(t, err)
		_, err = p.Exec(ctx, storage.S(`INSERT INTO "watermill_offsets_l" VALUES ('g', 0, '0')`))
		require.NoError(t, err)
		oid, err := storage.TableOID(ctx, p, `"watermill_l"`)
		require.NoError(t, err)
		lock := storage.NewSQLWakeLock(oid, `"watermill_l"`)
		look := func(group string) storage.SQLWakeLook {
			l, err := lock.Look(ctx, p, `"watermill_offsets_l"`, group)
			require.NoError(t, err)
			return l
		}
		insert := func() (offset int64, xid uint64) {
			var x string
			require.NoError(t, p.QueryRow(ctx, storage.S(`INSERT INTO "watermill_l" (transaction_id) VALUES (pg_current_xact_id()) RETURNING "offset", transaction_id::text`), &offset, &x))
			xid, err := strconv.ParseUint(x, 10, 64)
			require.NoError(t, err)
			return offset, xid
		}
		require.Equal(t, storage.SQLWakeLook{Horizon: look("g").Horizon}, look("g"), "an empty table")
		off, xid := insert()
		// Backlog, or hidden while another session on the server (another
		// test) holds the horizon: never neither, in one snapshot.
		l := look("g")
		require.True(t, l.Backlog != (l.Hidden >= xid), "a committed row is backlog or hidden: %+v, row %d", l, xid)
		require.False(t, look("other").Backlog, "a group without an offsets row")
		_, err = p.Exec(ctx, storage.S(`UPDATE "watermill_offsets_l" SET offset_acked = $1, last_processed_transaction_id = $2::text::xid8`, off, strconv.FormatUint(xid, 10)))
		require.NoError(t, err)
		require.False(t, look("g").Backlog, "a row the group acked")

		// A row committed while an older transaction runs is hidden, not
		// backlog, until that transaction ends.
		blocker, err := p.Begin(ctx, storage.TxOptions{})
		require.NoError(t, err)
		defer blocker.Rollback(ctx) //nolint:errcheck
		_, err = blocker.Exec(ctx, storage.S(`SELECT pg_current_xact_id()`))
		require.NoError(t, err)
		_, hidden := insert()
		l = look("g")
		require.False(t, l.Backlog)
		require.Equal(t, hidden, l.Hidden)
		require.LessOrEqual(t, l.Horizon, hidden)
		require.NoError(t, blocker.Commit(ctx))
		l = look("g")
		require.True(t, l.Backlog != (l.Hidden >= hidden), "a committed row is backlog or hidden: %+v, row %d", l, hidden)
	})

	// A LISTEN connection that goes silent (no RST, no FIN: a dropped NAT
	// entry, a dead middlebox) is found by the listener's ping within
	// PingInterval + PingTimeout and replaced: a nil (some notifications
	// may be lost), then the notifications sent after. Without the ping
	// the listener would wait on the dead connection for good (through
	// the proxy even TCP keepalive is answered).
	t.Run("ListenerReplacesASilentConnection", func(t *testing.T) {
		t.Parallel()
		s := setup(t)
		proxy, through, err := faultproxy.Through(s.Schema.URL, "5432")
		require.NoError(t, err)
		defer proxy.Close()
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		channel := "silent_" + s.Schema.Name
		l, err := storage.NewListener(lctx, s.Pool.Driver(), storage.ListenerConfig{URL: through,
			PingInterval: 200 * time.Millisecond, PingTimeout: time.Second, MinReconnect: 10 * time.Millisecond})
		require.NoError(t, err)
		defer l.Close()
		require.NoError(t, l.Listen(ctx, channel))
		limit := time.After(60 * time.Second) // fails a hang only
		next := func() *storage.Notification {
			t.Helper()
			select {
			case n, ok := <-l.Notifications():
				require.True(t, ok, "the listener ended")
				return n
			case <-limit:
				t.Fatalf("no notification (blackholed conns %d, dropped bytes %d)", proxy.Blackholed(), proxy.DroppedBytes())
				return nil
			}
		}
		require.NoError(t, storage.Notify(ctx, s.Pool, channel, "before"))
		require.Equal(t, "before", next().Payload)

		proxy.Blackhole()
		require.Positive(t, proxy.Blackholed(), "no connection was blackholed")
		require.NoError(t, storage.Notify(ctx, s.Pool, channel, "lost"))
		require.Nil(t, next(), "the silent connection was not replaced")
		require.Positive(t, proxy.DroppedBytes(), "nothing was dropped: the fault did not happen")
		require.NoError(t, storage.Notify(ctx, s.Pool, channel, "after"))
		for n := next(); n == nil || n.Payload != "after"; n = next() {
			require.True(t, n == nil || n.Payload == "lost", "unexpected %+v", n)
		}
	})

	// What the sql transport's check of its lock session reads: the
	// locks the session holds, and the session itself, which another
	// connection can end (a silent connection's session lives on).
	t.Run("WakeLockSession", func(t *testing.T) {
		t.Parallel()
		s := setup(t)
		p := s.Pool
		_, err := p.Exec(ctx, storage.S(`CREATE TABLE "watermill_s" ("offset" BIGSERIAL, transaction_id xid8 NOT NULL)`))
		require.NoError(t, err)
		oid, err := storage.TableOID(ctx, p, `"watermill_s"`)
		require.NoError(t, err)
		sess, closeSess, err := storage.OpenSession(ctx, p.Driver(), s.Schema.URL)
		require.NoError(t, err)
		defer closeSess()
		held, err := storage.SQLWakeLocksHeld(ctx, sess)
		require.NoError(t, err)
		require.Empty(t, held)
		state, err := storage.NewSQLWakeLock(oid, `"watermill_s"`).Try(ctx, sess)
		require.NoError(t, err)
		require.Equal(t, storage.SQLWakeHeld, state)
		held, err = storage.SQLWakeLocksHeld(ctx, sess)
		require.NoError(t, err)
		require.Equal(t, map[uint32]struct{}{oid: {}}, held)

		me, err := storage.ThisSession(ctx, sess)
		require.NoError(t, err)
		require.NotZero(t, me.PID)
		require.NotEmpty(t, me.Start)
		other := me
		other.Start += "1" // the same pid, a later session: not ended
		ended, err := storage.EndSession(ctx, p, other)
		require.NoError(t, err)
		require.False(t, ended)
		ended, err = storage.EndSession(ctx, p, me)
		require.NoError(t, err)
		require.True(t, ended)
		// (database/sql's pool of one replaces the ended connection on
		// its next use, pgx's fails it: what the session's holder sees
		// differs, what the server holds does not.)
		require.Eventually(t, func() bool {
			var n int
			return p.QueryRow(ctx, storage.S(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, me.PID), &n) == nil && n == 0
		}, 10*time.Second, 5*time.Millisecond, "the ended session still runs")
		require.Eventually(t, func() bool {
			var n int
			return p.QueryRow(ctx, storage.S(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 AND objid = $2::bigint::oid AND objsubid = 2`,
				storage.SQLWakeLockClass, int64(oid)), &n) == nil && n == 0
		}, 10*time.Second, 5*time.Millisecond, "the ended session's lock is still held")
		ended, err = storage.EndSession(ctx, p, me)
		require.NoError(t, err)
		require.False(t, ended, "a session that ended")
	})

	t.Run("MissingTable", func(t *testing.T) {
		t.Parallel()
		_, err := storage.TableOID(ctx, setup(t).Pool, `"watermill_absent"`)
		require.Error(t, err)
	})

	t.Run("ForeignPayload", func(t *testing.T) {
		t.Parallel()
		for _, p := range []string{"", "x", "12", "12 x", "x 12", "-1 5", "4294967296 1"} {
			_, _, ok := storage.ParseSQLNotification(p)
			require.False(t, ok, "%q", p)
		}
	})
}
