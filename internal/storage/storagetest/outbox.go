package storagetest

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("outbox", exerciseOutbox) }

// allLanes lists the outbox's 64 lanes.
func allLanes() []int32 {
	l := make([]int32, 64)
	for i := range l {
		l[i] = int32(i)
	}
	return l
}

func equal(n int, lanes []int32) []int32 {
	s := make([]int32, len(lanes))
	for i := range s {
		s[i] = int32(n)
	}
	return s
}

func insertEvents(t *testing.T, q storage.Querier, agg string, n int) {
	t.Helper()
	rows := make([]storage.EventRow, n)
	for i := range rows {
		rows[i] = storage.EventRow{EventID: fmt.Sprintf("%s-%d", agg, i), Topic: "t", AggregateType: "acct", AggregateID: agg,
			EventType: "e", Payload: []byte(fmt.Sprintf(`{"i": %d}`, i)), IsJSON: true}
	}
	require.NoError(t, storage.InsertEvents(context.Background(), q, rows))
}

func claimAll(t *testing.T, q storage.Querier, batch int) []storage.ClaimedEvent {
	t.Helper()
	var out []storage.ClaimedEvent
	require.NoError(t, storage.ClaimEvents(context.Background(), q, allLanes(), batch, equal(batch, allLanes()), func(e storage.ClaimedEvent) error {
		out = append(out, e)
		return nil
	}))
	return out
}

// takeLanes makes relay id hold every lane (a RunOnce-like relay: not a
// member, so it takes what is free at once).
func takeLanes(t *testing.T, q storage.Querier, id string) storage.LaneState {
	t.Helper()
	st, err := storage.CheckLanes(context.Background(), q, storage.LaneCheck{Relay: id, Lease: time.Minute, Take: true, Load: "some"})
	require.NoError(t, err)
	return st
}

func exerciseOutbox(t *testing.T, setup func(t *testing.T) Setup) {
	t.Run("InsertClaimMark", func(t *testing.T) { t.Parallel(); outboxInsertClaimMark(t, setup(t)) })
	t.Run("RecordFailures", func(t *testing.T) { t.Parallel(); outboxRecordFailures(t, setup(t)) })
	t.Run("Lanes", func(t *testing.T) { t.Parallel(); outboxLanes(t, setup(t)) })
	t.Run("Readers", func(t *testing.T) { t.Parallel(); outboxReaders(t, setup(t)) })
	t.Run("RetryFailed", func(t *testing.T) { t.Parallel(); outboxRetryFailed(t, setup(t)) })
	t.Run("WakeLockAndListen", func(t *testing.T) { t.Parallel(); outboxWakeAndListen(t, setup(t)) })
	t.Run("ListenReconnects", func(t *testing.T) { t.Parallel(); outboxListenReconnects(t, setup(t)) })
	t.Run("Move", func(t *testing.T) { t.Parallel(); outboxMove(t, setup(t)) })
	t.Run("Checks", func(t *testing.T) { t.Parallel(); outboxChecks(t, setup(t)) })
}

// Insert writes JSON and raw payloads; the claim returns each lane's due
// rows in id order with their columns; the mark writes only rows of lanes
// the relay holds.
func outboxInsertClaimMark(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	require.NoError(t, storage.InsertEvents(ctx, p, []storage.EventRow{
		{EventID: "e-1", Topic: "t", AggregateType: "acct", AggregateID: "a", EventType: "x", Payload: []byte(`{"k": "it's"}`), IsJSON: true, Metadata: `{"m":"v"}`},
		{EventID: "e-2", Topic: "t", AggregateType: "acct", AggregateID: "a", EventType: "x", Payload: []byte{0, 0xff, '\''}},
	}))
	insertEvents(t, p, "b", 3)
	got := claimAll(t, p, 100)
	require.Len(t, got, 5)
	byAgg := map[string][]storage.ClaimedEvent{}
	for _, e := range got {
		byAgg[e.AggID] = append(byAgg[e.AggID], e)
	}
	a := byAgg["a"]
	require.Len(t, a, 2)
	require.Equal(t, "e-1", a[0].EventID)
	require.True(t, a[0].Payload.Valid)
	require.JSONEq(t, `{"k": "it's"}`, a[0].Payload.String)
	require.JSONEq(t, `{"m":"v"}`, a[0].Metadata.String)
	require.False(t, a[1].Payload.Valid)
	require.Equal(t, []byte{0, 0xff, '\''}, a[1].Raw)
	require.False(t, a[1].Metadata.Valid, "metadata {} reads as NULL")
	require.Equal(t, a[0].Lane, a[1].Lane, "an aggregate is one lane")
	require.Less(t, a[0].ID, a[1].ID)
	require.WithinDuration(t, time.Now(), a[0].CreatedAt, time.Minute)
	require.Zero(t, a[0].Failing)
	require.Len(t, claimAll(t, p, 2), 2, "the batch bounds the claim")

	ids := make([]int64, len(got))
	for i, e := range got {
		ids[i] = e.ID
	}
	n, err := storage.MarkPublished(ctx, p, "relay-1", ids)
	require.NoError(t, err)
	require.Zero(t, n, "no lane held: nothing marked")
	st := takeLanes(t, p, "relay-1")
	require.Len(t, st.Held, 64)
	n, err = storage.MarkPublished(ctx, p, "relay-1", ids)
	require.NoError(t, err)
	require.EqualValues(t, 5, n)
	require.Empty(t, claimAll(t, p, 100))
	n, err = storage.MarkPublished(ctx, p, "relay-1", ids)
	require.NoError(t, err)
	require.Zero(t, n, "published rows are not marked again")
}

// A failure record backs the row off (holding back its aggregate's later
// rows) or fails it for good, only on lanes the relay holds.
func outboxRecordFailures(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	insertEvents(t, p, "a", 2)
	insertEvents(t, p, "b", 1)
	got := claimAll(t, p, 100)
	require.Len(t, got, 3)
	var a0, b0 storage.ClaimedEvent
	for _, e := range got {
		switch e.EventID {
		case "a-0":
			a0 = e
		case "b-0":
			b0 = e
		}
	}
	fs := []storage.FailedAttempt{{ID: a0.ID, Delay: time.Hour, Error: "it's down"}, {ID: b0.ID, Error: "for good", Final: true}}
	recs, err := storage.RecordFailures(ctx, p, "relay-1", fs)
	require.NoError(t, err)
	require.Empty(t, recs, "no lane held: nothing recorded")
	takeLanes(t, p, "relay-1")
	recs, err = storage.RecordFailures(ctx, p, "relay-1", fs)
	require.NoError(t, err)
	require.Len(t, recs, 2)
	for _, r := range recs {
		require.WithinDuration(t, r.Now, r.FirstFailed, time.Second)
	}
	require.Empty(t, claimAll(t, p, 100), "a-0 backs off and holds a-1 back; b-0 failed")
	var status, lastErr string
	var retries int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT status, last_error, retry_count FROM millwright_outbox WHERE id = $1`, b0.ID), &status, &lastErr, &retries))
	require.Equal(t, "failed", status)
	require.Equal(t, "for good", lastErr)
	require.Equal(t, 1, retries)

	// Due again: claimed with how long it has been failing.
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_outbox SET next_attempt_at = now(), first_failed_at = now() - interval '2 seconds' WHERE id = $1`, a0.ID))
	require.NoError(t, err)
	again := claimAll(t, p, 100)
	require.Len(t, again, 2)
	require.Equal(t, a0.ID, again[0].ID)
	require.Equal(t, 1, again[0].RetryCount)
	require.InDelta(t, 2*time.Second, again[0].Failing, float64(time.Second))
}

// Relays divide the lanes: one takes all, a second member announces itself
// and then takes its half; the quick check sees them; lanes lent go to a
// spare relay; freeing gives every lane back.
func outboxLanes(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	check := func(id string, take bool, load string) storage.LaneState {
		t.Helper()
		st, err := storage.CheckLanes(ctx, p, storage.LaneCheck{Relay: id, Lease: time.Minute, Member: true, Take: take, Load: load})
		require.NoError(t, err)
		return st
	}
	check("relay-a", false, "some")
	st := check("relay-a", true, "some")
	require.Len(t, st.Held, 64)
	require.Equal(t, 1, st.Relays)
	require.Greater(t, st.LeaseLeft, 50*time.Second)
	require.Equal(t, "relay-a:some", st.Seen)
	seen, moving, err := storage.QuickLaneCheck(ctx, p)
	require.NoError(t, err)
	require.Equal(t, "relay-a:some", seen)
	require.False(t, moving)

	check("relay-b", false, "spare")
	st = check("relay-a", true, "full")
	require.Len(t, st.Held, 32, "relay-a frees relay-b's share")
	require.Equal(t, []string{"relay-b"}, st.Spares)
	require.Equal(t, []string{"relay-a"}, st.Fulls)
	_, moving, err = storage.QuickLaneCheck(ctx, p)
	require.NoError(t, err)
	require.True(t, moving, "lanes are free")
	b := check("relay-b", true, "spare")
	require.Len(t, b.Held, 32)

	lent, err := storage.LendLanes(ctx, p, "relay-a", time.Minute, st.Held[:2], []string{"relay-b", "relay-b"})
	require.NoError(t, err)
	require.Equal(t, st.Held[:2], lent)
	b = check("relay-b", true, "some")
	require.Len(t, b.Held, 34)
	require.Equal(t, st.Held[:2], b.Borrowed)

	require.NoError(t, storage.FreeLanes(ctx, p, "relay-b", "", ""))
	require.NoError(t, storage.FreeLanes(ctx, p, "relay-a", "some_channel", "lanes"))
	var free int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox_lanes WHERE owner IS NULL`), &free))
	require.Equal(t, 64, free)
	require.NoError(t, storage.Notify(ctx, p, "some_channel", "x"))
}

func outboxReaders(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	st, err := storage.ReadOutboxStats(ctx, p)
	require.NoError(t, err)
	require.Equal(t, storage.OutboxStats{}, st)
	insertEvents(t, p, "a", 2)
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_outbox SET created_at = now() - interval '1 minute', status = 'failed', retry_count = 3, last_error = $1 WHERE event_id = 'a-0'`, strings.Repeat("é", 20)))
	require.NoError(t, err)
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_outbox SET retry_count = 1, last_error = 'soon' WHERE event_id = 'a-1'`))
	require.NoError(t, err)
	st, err = storage.ReadOutboxStats(ctx, p)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Pending)
	require.EqualValues(t, 1, st.Failed)
	require.Less(t, st.OldestPendingAge, 30*time.Second)
	ts, err := storage.ReadOutboxTopicStats(ctx, p)
	require.NoError(t, err)
	require.Len(t, ts, 1)
	require.Equal(t, "t", ts[0].Topic)
	require.EqualValues(t, 1, ts[0].Pending)
	require.EqualValues(t, 1, ts[0].Failed)
	ps, err := storage.ReadOutboxProblems(ctx, p, 10, 5)
	require.NoError(t, err)
	require.Len(t, ps, 2)
	require.True(t, ps[0].Failed)
	require.Equal(t, "a-0", ps[0].EventID)
	require.Equal(t, strings.Repeat("é", 5), ps[0].LastError, "cut to 5 characters")
	require.False(t, ps[1].Failed)
	require.Equal(t, 1, ps[1].RetryCount)
}

func outboxRetryFailed(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	insertEvents(t, p, "a", 3)
	_, err := p.Exec(ctx, storage.S(`UPDATE millwright_outbox SET status = 'failed', retry_count = 5`))
	require.NoError(t, err)
	all, err := storage.ListFailedEvents(ctx, p, "", nil, false)
	require.NoError(t, err)
	require.Len(t, all, 3)
	none, err := storage.ListFailedEvents(ctx, p, "other", nil, false)
	require.NoError(t, err)
	require.Empty(t, none)
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	some, err := storage.ListFailedEvents(ctx, tx, "t", []int64{all[0].ID, all[2].ID}, true)
	require.NoError(t, err)
	require.Len(t, some, 2)
	require.Equal(t, 5, some[0].RetryCount)
	n, err := storage.ResetFailedEvents(ctx, tx, []int64{some[0].ID, some[1].ID})
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.NoError(t, storage.NotifyOutboxRelays(ctx, tx))
	require.NoError(t, tx.Commit(ctx))
	st, err := storage.ReadOutboxStats(ctx, p)
	require.NoError(t, err)
	require.EqualValues(t, 2, st.Pending)
	require.EqualValues(t, 1, st.Failed)
}

// The wake-up lock is a session's: held by the first session, "other" for
// a second; a writer's notification at commit reaches a Listener of the
// driver, and so does the hand-over's.
func outboxWakeAndListen(t *testing.T, s Setup) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := s.Pool
	tbl, err := storage.FindOutboxTable(ctx, p)
	require.NoError(t, err)
	require.Equal(t, s.Schema.Name, tbl.Schema)
	require.NotZero(t, tbl.OID)
	require.Equal(t, storage.OutboxNotifyPrefix+s.Schema.Name, tbl.Channel)

	l, err := storage.NewListener(ctx, p.Driver(), storage.ListenerConfig{URL: s.Schema.URL})
	require.NoError(t, err)
	defer l.Close()
	require.NoError(t, l.Listen(ctx, tbl.Channel))

	one, closeOne, err := storage.OpenSession(ctx, p.Driver(), s.Schema.URL)
	require.NoError(t, err)
	defer closeOne()
	two, closeTwo, err := storage.OpenSession(ctx, p.Driver(), s.Schema.URL)
	require.NoError(t, err)
	defer closeTwo()
	w, err := storage.NewWakeLock(tbl.OID, tbl.Channel, time.Minute)
	require.NoError(t, err)
	state, err := w.Try(ctx, one)
	require.NoError(t, err)
	require.Equal(t, storage.WakeLockHeld, state)
	state, err = w.Try(ctx, two)
	require.NoError(t, err)
	require.Equal(t, storage.WakeLockOther, state)

	insertEvents(t, p, "a", 1) // the trigger notifies while the lock is held
	next := func() *storage.Notification {
		t.Helper()
		select {
		case n := <-l.Notifications():
			return n
		case <-ctx.Done():
			t.Fatal("no notification")
			return nil
		}
	}
	n := next()
	require.NotNil(t, n)
	require.Equal(t, tbl.Channel, n.Channel)
	require.NoError(t, w.Unlock(ctx, one, true))
	require.Equal(t, "", next().Payload, "the hand-over notifies")
	state, err = w.Try(ctx, two)
	require.NoError(t, err)
	require.Equal(t, storage.WakeLockHeld, state, "given back: the other session takes it")
	require.NoError(t, w.Unlock(ctx, two, false))
	require.NoError(t, l.Close())
	_, open := <-l.Notifications()
	require.False(t, open, "Close closes the channel")
}

// The in-database claim marks the rows published in its transaction, and
// MoveInsert copies them into a topic table in one Batch, with the trace
// overrides merged.
func outboxMove(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	_, err := p.Exec(ctx, storage.S(`CREATE TABLE topic_t ("offset" bigserial, uuid varchar(36) NOT NULL, created_at timestamptz DEFAULT now(),
		payload bytea, metadata json, transaction_id xid8 NOT NULL)`))
	require.NoError(t, err)
	insertEvents(t, p, "a", 3)
	tx, err := p.Begin(ctx, storage.TxOptions{First: storage.MoveSettings(time.Minute)})
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var ids []int64
	require.NoError(t, storage.MoveClaim(ctx, tx, allLanes(), 100, equal(100, allLanes()), func(m storage.MovedRow) error {
		require.True(t, m.Plain)
		require.Equal(t, "t", m.Topic)
		ids = append(ids, m.ID)
		return nil
	}))
	require.Len(t, ids, 3)
	tp := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	require.NoError(t, tx.Batch(ctx, storage.MoveInsert(`topic_t`, ids[:1], []storage.TraceOverride{{ID: ids[0], Meta: map[string]string{"traceparent": tp}}}),
		storage.MoveInsert(`topic_t`, ids[1:], nil)))
	require.NoError(t, tx.Commit(ctx))
	var n int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE status = 'published'`), &n))
	require.Equal(t, 3, n)
	var uuids []string
	require.NoError(t, p.Query(ctx, storage.S(`SELECT uuid, metadata::text FROM topic_t ORDER BY "offset"`), func(r storage.Row) error {
		var u, md string
		if err := r.Scan(&u, &md); err != nil {
			return err
		}
		var m map[string]string
		require.NoError(t, json.Unmarshal([]byte(md), &m))
		if u == "a-0" {
			require.Equal(t, tp, m["traceparent"])
		}
		require.Equal(t, u, m["ce_id"])
		uuids = append(uuids, u)
		return nil
	}))
	require.Equal(t, []string{"a-0", "a-1", "a-2"}, uuids)
	a, err := storage.DatabaseIdentity(ctx, p)
	require.NoError(t, err)
	b, err := storage.DatabaseIdentity(ctx, storage.NewSQL(s.Schema.DB))
	require.NoError(t, err)
	require.Equal(t, a, b)
}

func outboxChecks(t *testing.T, s Setup) {
	ctx := context.Background()
	p := s.Pool
	require.NoError(t, storage.CheckOutboxColumns(ctx, p))
	info, err := storage.LookupTables(ctx, p, "millwright_outbox", "nope_a", "millwright_outbox_lanes", "nope_b")
	require.NoError(t, err)
	require.Equal(t, []string{"nope_a", "nope_b"}, info.Missing)
	require.Equal(t, s.Schema.Name, info.Schema)
	require.Contains(t, info.SearchPath, s.Schema.Name)
	info, err = storage.LookupTables(ctx, p, "millwright_outbox")
	require.NoError(t, err)
	require.Empty(t, info.Missing)
	_, err = p.Exec(ctx, storage.S(`ALTER TABLE millwright_outbox DROP COLUMN first_failed_at`))
	require.NoError(t, err)
	require.Equal(t, "42703", storage.Code(storage.CheckOutboxColumns(ctx, p)))
}

// A Listener whose connection the server ends reconnects, says so (a nil
// notification: some may have been missed) and LISTENs again; ending its
// ctx closes it.
func outboxListenReconnects(t *testing.T, s Setup) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := s.Pool
	channel := "ch_" + s.Schema.Name
	lctx, stop := context.WithCancel(ctx)
	l, err := storage.NewListener(lctx, p.Driver(), storage.ListenerConfig{URL: s.Schema.URL, MinReconnect: 10 * time.Millisecond, MaxReconnect: 100 * time.Millisecond})
	require.NoError(t, err)
	defer l.Close()
	require.NoError(t, l.Listen(ctx, channel))
	next := func() *storage.Notification {
		t.Helper()
		select {
		case n := <-l.Notifications():
			return n
		case <-ctx.Done():
			t.Fatal("no notification")
			return nil
		}
	}
	require.NoError(t, storage.Notify(ctx, p, channel, "one"))
	require.Equal(t, "one", next().Payload)
	var killed int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND query ILIKE 'LISTEN %' AND query LIKE '%' || $1 || '%'`, channel), &killed))
	require.Equal(t, 1, killed, "the listener's session")
	require.Nil(t, next(), "reconnected")
	require.NoError(t, storage.Notify(ctx, p, channel, "two"))
	require.Equal(t, "two", next().Payload)
	stop()
	select {
	case _, open := <-l.Notifications():
		for open { // a notification or a reconnection may be in flight
			_, open = <-l.Notifications()
		}
	case <-ctx.Done():
		t.Fatal("the listener did not end with its ctx")
	}
}
