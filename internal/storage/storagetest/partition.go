package storagetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("partition", exercisePartition) }

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
	t.Run("IsPartitioned", func(t *testing.T) {
		t.Parallel()
		partitionIsPartitioned(t, setup)
	})
	t.Run("ListPartitionsAndExpiry", func(t *testing.T) {
		t.Parallel()
		partitionListPartitionsAndExpiry(t, setup)
	})
	t.Run("KeptRowsAndCountRows", func(t *testing.T) {
		t.Parallel()
		partitionKeptRowsAndCountRows(t, setup)
	})
	t.Run("CreatePartitionAttachesWithItsStorageParameters", func(t *testing.T) {
		t.Parallel()
		partitionCreatePartitionAttachesWithItsStorageParameters(t, setup)
	})
	t.Run("DetachRestoreDrop", func(t *testing.T) {
		t.Parallel()
		partitionDetachRestoreDrop(t, setup)
	})
}

// eventsSetup is the setup of the partition contracts.
func eventsSetup(t *testing.T, setup func(t *testing.T) Setup) (Setup, time.Time) {
	ctx := context.Background()
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

func partitionIsPartitioned(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s, _ := eventsSetup(t, setup)
	part, err := storage.IsPartitioned(ctx, s.Pool, "events")
	require.NoError(t, err)
	require.True(t, part)
	part, err = storage.IsPartitioned(ctx, s.Pool, "events_default")
	require.NoError(t, err)
	require.False(t, part)
	_, err = storage.IsPartitioned(ctx, s.Pool, "absent")
	require.Error(t, err)
	require.Equal(t, "42P01", storage.Code(err))
}

func partitionListPartitionsAndExpiry(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s, today := eventsSetup(t, setup)
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
}

func partitionKeptRowsAndCountRows(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s, today := eventsSetup(t, setup)
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
}

func partitionCreatePartitionAttachesWithItsStorageParameters(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s, today := eventsSetup(t, setup)
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
}

func partitionDetachRestoreDrop(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s, today := eventsSetup(t, setup)
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
}
