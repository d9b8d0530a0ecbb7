package storagetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() {
	Register("cleaner", exerciseCleaner)
	Register("partition", exercisePartition)
	Register("schema", exerciseSchema)
}

// things is a retention table of the contracts: done rows older than the
// retention go.
var things = storage.RetentionTable{
	Name: "things", Key: "id", OrderBy: "id",
	Where:     `done AND at < now() - $1 * interval '1 millisecond'`,
	LockClass: 0x73746f72,
}

// exerciseCleaner checks the retention operations.
func exerciseCleaner(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	mk := func(t *testing.T) Setup {
		s := setup(t)
		// pgx prepares a batch's statements before it runs the first: the
		// table is created before the batch that fills it.
		_, err := s.Pool.Exec(ctx, storage.S(`CREATE TABLE things (id bigserial PRIMARY KEY, done bool NOT NULL, at timestamptz NOT NULL)`))
		require.NoError(t, err)
		require.NoError(t, s.Pool.Batch(ctx,
			storage.S(`INSERT INTO things (done, at) SELECT true, now() - interval '2 hours' FROM generate_series(1, 12)`),
			storage.S(`INSERT INTO things (done, at) SELECT false, now() - interval '2 hours' FROM generate_series(1, 3)`),
			storage.S(`INSERT INTO things (done, at) SELECT true, now() FROM generate_series(1, 4)`)))
		return s
	}

	t.Run("DeleteRetainedInBatches", func(t *testing.T) {
		t.Parallel()
		s := mk(t)
		n, err := storage.CountRetained(ctx, s.Pool, things, time.Hour)
		require.NoError(t, err)
		require.EqualValues(t, 12, n)
		var got []int64
		for {
			n, err := storage.DeleteRetained(ctx, s.Pool, things, time.Hour, 5)
			require.NoError(t, err)
			got = append(got, n)
			if n < 5 {
				break
			}
		}
		require.Equal(t, []int64{5, 5, 2}, got, "at most limit rows a statement")
		var left int64
		require.NoError(t, s.Pool.QueryRow(ctx, storage.S(`SELECT count(*) FROM things`), &left))
		require.EqualValues(t, 7, left, "rows not done and recent rows stay")
	})

	t.Run("DeleteRetainedSkipsLockedRows", func(t *testing.T) {
		t.Parallel()
		s := mk(t)
		tx, err := s.Pool.Begin(ctx, storage.TxOptions{})
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // test
		_, err = tx.Exec(ctx, storage.S(`SELECT id FROM things ORDER BY id LIMIT 2 FOR UPDATE`))
		require.NoError(t, err)
		n, err := storage.DeleteRetained(ctx, s.Pool, things, time.Hour, 100)
		require.NoError(t, err, "does not wait on the locked rows")
		require.EqualValues(t, 10, n)
	})

	t.Run("RetentionLockIsExclusivePerSchema", func(t *testing.T) {
		t.Parallel()
		s := mk(t)
		a, err := storage.AcquireSession(ctx, s.Pool)
		require.NoError(t, err)
		defer a.Release()
		b, err := storage.AcquireSession(ctx, s.Pool)
		require.NoError(t, err)
		defer b.Release()
		ok, err := storage.TryRetentionLock(ctx, a, things)
		require.NoError(t, err)
		require.True(t, ok)
		ok, err = storage.TryRetentionLock(ctx, b, things)
		require.NoError(t, err)
		require.False(t, ok, "another session of the same schema")

		other := setup(t) // another schema
		c, err := storage.AcquireSession(ctx, other.Pool)
		require.NoError(t, err)
		defer c.Release()
		ok, err = storage.TryRetentionLock(ctx, c, things)
		require.NoError(t, err)
		require.True(t, ok, "a session of another schema")
		require.NoError(t, storage.RetentionUnlock(ctx, c, things))

		require.NoError(t, storage.RetentionUnlock(ctx, a, things))
		ok, err = storage.TryRetentionLock(ctx, b, things)
		require.NoError(t, err)
		require.True(t, ok, "free once unlocked")
		require.NoError(t, storage.RetentionUnlock(ctx, b, things))
	})

	t.Run("SessionTransaction", func(t *testing.T) {
		t.Parallel()
		s := mk(t)
		sess, err := storage.AcquireSession(ctx, s.Pool)
		require.NoError(t, err)
		defer sess.Release()
		var pid, inTx int64
		require.NoError(t, sess.QueryRow(ctx, storage.S(`SELECT pg_backend_pid()`), &pid))
		tx, err := sess.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, tx.QueryRow(ctx, storage.S(`SELECT pg_backend_pid()`), &inTx))
		require.Equal(t, pid, inTx, "the transaction runs on the session's connection")
		_, err = storage.DeleteRetained(ctx, tx, things, time.Hour, 100)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(ctx))
		n, err := storage.CountRetained(ctx, sess, things, time.Hour)
		require.NoError(t, err)
		require.EqualValues(t, 12, n, "rolled back")
		sess.Release()
		sess.Release() // idempotent
	})
}

// events is a partitioned retention table of the contracts.
var events = storage.RetentionTable{
	Name: "events", Key: "id", OrderBy: "id",
	Where:      `done AND at < now() - $1 * interval '1 millisecond'`,
	LockClass:  0x73746f73,
	Partitions: &storage.PartitionSpec{Keep: []string{"NOT done", "at IS NULL"}, With: "fillfactor = 90"},
}

func partitionName(day time.Time) string { return "events_p" + day.Format("20060102") }

// exercisePartition checks the partition maintenance operations.
func exercisePartition(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	mk := func(t *testing.T) (Setup, time.Time) {
		s := setup(t)
		today, err := storage.UTCToday(ctx, s.Pool)
		require.NoError(t, err)
		require.Equal(t, time.UTC, today.Location())
		require.Zero(t, today.Hour())
		_, err = s.Pool.Exec(ctx, storage.S(`CREATE TABLE events (id bigserial, done bool NOT NULL, at timestamptz NOT NULL, PRIMARY KEY (id, at)) PARTITION BY RANGE (at)`))
		require.NoError(t, err)
		ddl := []storage.Statement{storage.S(`CREATE TABLE events_default PARTITION OF events DEFAULT`)}
		var rows []storage.Statement
		for d := -3; d < 0; d++ {
			day := today.AddDate(0, 0, d)
			ddl = append(ddl, storage.S(fmt.Sprintf(`CREATE TABLE %s PARTITION OF events FOR VALUES FROM ('%s') TO ('%s')`,
				partitionName(day), day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339))))
			rows = append(rows, storage.S(`INSERT INTO events (done, at) SELECT true, $1::timestamptz + interval '1 hour' FROM generate_series(1, 10)`, day))
		}
		require.NoError(t, s.Pool.Batch(ctx, ddl...))
		require.NoError(t, s.Pool.Batch(ctx, rows...))
		return s, today
	}

	t.Run("IsPartitioned", func(t *testing.T) {
		t.Parallel()
		s, _ := mk(t)
		part, err := storage.IsPartitioned(ctx, s.Pool, "events")
		require.NoError(t, err)
		require.True(t, part)
		part, err = storage.IsPartitioned(ctx, s.Pool, "events_default")
		require.NoError(t, err)
		require.False(t, part)
		_, err = storage.IsPartitioned(ctx, s.Pool, "absent")
		require.Error(t, err)
		require.Equal(t, "42P01", storage.Code(err))
	})

	t.Run("ListPartitionsAndExpiry", func(t *testing.T) {
		t.Parallel()
		s, today := mk(t)
		ps, err := storage.ListPartitions(ctx, s.Pool, "events", 36*time.Hour)
		require.NoError(t, err)
		require.Len(t, ps, 4)
		for i, d := range []int{-3, -2, -1} {
			p := ps[i]
			require.Equal(t, partitionName(today.AddDate(0, 0, d)), p.Name)
			require.False(t, p.IsDefault)
			require.True(t, p.Upper.Valid)
			require.True(t, today.AddDate(0, 0, d+1).Equal(p.Upper.Time), "upper bound of %s: %v", p.Name, p.Upper.Time)
		}
		require.True(t, ps[0].Expired, "ended 2 days ago, retention 36h")
		require.False(t, ps[2].Expired, "ended today")
		require.Equal(t, "events_default", ps[3].Name)
		require.True(t, ps[3].IsDefault)
		require.False(t, ps[3].Upper.Valid)
		require.False(t, ps[3].Expired)
	})

	t.Run("KeptRowsAndCountRows", func(t *testing.T) {
		t.Parallel()
		s, today := mk(t)
		name := partitionName(today.AddDate(0, 0, -2))
		n, err := storage.KeptRows(ctx, s.Pool, events, name)
		require.NoError(t, err)
		require.Zero(t, n)
		_, err = s.Pool.Exec(ctx, storage.S(`UPDATE events SET done = false WHERE id IN (SELECT id FROM `+name+` ORDER BY id LIMIT 3)`))
		require.NoError(t, err)
		n, err = storage.KeptRows(ctx, s.Pool, events, name)
		require.NoError(t, err)
		require.EqualValues(t, 3, n, "the sum over every Keep predicate")
		n, err = storage.CountRows(ctx, s.Pool, name, 4)
		require.NoError(t, err)
		require.EqualValues(t, 4, n, "at most the cap")
		n, err = storage.CountRows(ctx, s.Pool, "events_default", 100)
		require.NoError(t, err)
		require.Zero(t, n)
	})

	t.Run("CreatePartitionAttachesWithItsStorageParameters", func(t *testing.T) {
		t.Parallel()
		s, today := mk(t)
		sess, err := storage.AcquireSession(ctx, s.Pool)
		require.NoError(t, err)
		defer sess.Release()
		tx, err := sess.Begin(ctx)
		require.NoError(t, err)
		name := partitionName(today)
		require.NoError(t, storage.CreatePartition(ctx, tx, events, name, today, today.AddDate(0, 0, 1), time.Second))
		require.NoError(t, tx.Commit(ctx))
		var opts string
		require.NoError(t, s.Pool.QueryRow(ctx, storage.S(`SELECT coalesce(array_to_string(c.reloptions, ','), '') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
			WHERE i.inhparent = 'events'::regclass AND c.relname = $1`, name), &opts))
		require.Equal(t, "fillfactor=90", opts)

		// Rows of the day in the DEFAULT partition refuse the ATTACH.
		tomorrow := today.AddDate(0, 0, 1)
		_, err = s.Pool.Exec(ctx, storage.S(`INSERT INTO events (done, at) VALUES (true, $1)`, tomorrow.Add(time.Hour)))
		require.NoError(t, err)
		tx, err = sess.Begin(ctx)
		require.NoError(t, err)
		err = storage.CreatePartition(ctx, tx, events, partitionName(tomorrow), tomorrow, tomorrow.AddDate(0, 0, 1), time.Second)
		require.Error(t, err)
		require.Equal(t, "23514", storage.Code(err))
		require.NoError(t, tx.Rollback(ctx))
	})

	t.Run("DetachRestoreDrop", func(t *testing.T) {
		t.Parallel()
		s, today := mk(t)
		sess, err := storage.AcquireSession(ctx, s.Pool)
		require.NoError(t, err)
		defer sess.Release()
		tx, err := sess.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, storage.SetLockTimeout(ctx, tx, time.Second))
		keep, drop := partitionName(today.AddDate(0, 0, -3)), partitionName(today.AddDate(0, 0, -2))
		require.NoError(t, storage.DetachPartition(ctx, tx, events, keep))
		require.NoError(t, storage.RestorePartition(ctx, tx))
		require.NoError(t, storage.DetachPartition(ctx, tx, events, drop))
		require.NoError(t, storage.DropPartition(ctx, tx, drop))
		require.NoError(t, tx.Commit(ctx))
		ps, err := storage.ListPartitions(ctx, s.Pool, "events", time.Hour)
		require.NoError(t, err)
		var names []string
		for _, p := range ps {
			names = append(names, p.Name)
		}
		require.Equal(t, []string{keep, partitionName(today.AddDate(0, 0, -1)), "events_default"}, names)
		var n int64
		require.NoError(t, s.Pool.QueryRow(ctx, storage.S(`SELECT count(*) FROM events`), &n))
		require.EqualValues(t, 20, n)
	})
}

// exerciseSchema checks LookupTables, which schemacheck uses.
func exerciseSchema(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	t.Run("LookupTables", func(t *testing.T) {
		t.Parallel()
		s := setup(t)
		info, err := storage.LookupTables(ctx, s.Pool, "millwright_outbox", "absent_b", "millwright_audit", "absent_a")
		require.NoError(t, err)
		require.Equal(t, []string{"absent_b", "absent_a"}, info.Missing, "in the order asked")
		require.Equal(t, s.Schema.Name, info.Schema)
		require.Contains(t, info.SearchPath, s.Schema.Name)
		info, err = storage.LookupTables(ctx, s.Pool, "millwright_outbox")
		require.NoError(t, err)
		require.Empty(t, info.Missing)
		schema, path, err := storage.CurrentSchema(ctx, s.Pool)
		require.NoError(t, err)
		require.Equal(t, s.Schema.Name, schema)
		require.Equal(t, info.SearchPath, path)
	})
}
