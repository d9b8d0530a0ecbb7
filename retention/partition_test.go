package retention

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

var events = Table{
	Component: "test", Rows: "events",
	Store: storage.RetentionTable{
		Name: "events", Key: "id", OrderBy: "id",
		Where:      `done AND at < now() - $1 * interval '1 millisecond'`,
		LockClass:  0x74657375,
		Partitions: &storage.PartitionSpec{Keep: []string{"NOT done"}, With: "fillfactor = 90"},
	},
	DefaultRetention: time.Hour, MinRetention: time.Millisecond,
}

// partitionedEvents returns a schema with events partitioned by UTC day:
// days -3..-1 hold 10 done rows each, plus a DEFAULT partition.
func partitionedEvents(t *testing.T) (*pgtest.Schema, time.Time) {
	t.Helper()
	s := pgtest.New(t)
	_, err := s.DB.Exec(`CREATE TABLE events (id BIGSERIAL, done BOOLEAN NOT NULL, at TIMESTAMPTZ NOT NULL, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
		CREATE INDEX ON events (id) WHERE NOT done;
		CREATE TABLE events_default PARTITION OF events DEFAULT`)
	require.NoError(t, err)
	var today time.Time
	require.NoError(t, s.DB.QueryRow(`SELECT date_trunc('day', now() AT TIME ZONE 'UTC')::timestamp`).Scan(&today))
	today = time.Date(today.Year(), today.Month(), today.Day(), 0, 0, 0, 0, time.UTC)
	for d := -3; d < 0; d++ {
		day := today.AddDate(0, 0, d)
		_, err := s.DB.Exec(fmt.Sprintf(`CREATE TABLE %s PARTITION OF events FOR VALUES FROM ('%s') TO ('%s')`,
			PartitionName("events", day), day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339)))
		require.NoError(t, err)
		_, err = s.DB.Exec(`INSERT INTO events (done, at) SELECT true, $1::timestamptz + interval '1 hour' FROM generate_series(1, 10)`, day)
		require.NoError(t, err)
	}
	return s, today
}

// TestPartitionRound_RowKeptAfterTheFirstLookKeepsItsPartition: a row that
// becomes one to keep between the look without a lock and the drop (as
// `outbox retry-failed` could make a failed row pending) keeps its
// partition: the look is repeated under the lock, and only that
// partition's detach is rolled back.
func TestPartitionRound_RowKeptAfterTheFirstLookKeepsItsPartition(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testRowKeptAfterTheFirstLook(t, driver)
	})
}

func testRowKeptAfterTheFirstLook(t *testing.T, driver string) {
	s, today := partitionedEvents(t)
	c, err := New(s.Pool(t, driver), events, Config{Retention: time.Millisecond, PartitionsAhead: 1})
	require.NoError(t, err)
	revived := PartitionName("events", today.AddDate(0, 0, -2))
	called := false
	c.beforeDrop = func() {
		called = true
		_, err := s.DB.Exec(`UPDATE ` + revived + ` SET done = false WHERE id = (SELECT min(id) FROM ` + revived + `)`)
		require.NoError(t, err)
	}
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.True(t, called, "the fault was injected")
	require.Equal(t, 2, stats.PartitionsDropped)
	require.Equal(t, []string{revived + " (1 rows where NOT done)"}, stats.PartitionsKept)
	require.Equal(t, 2, stats.PartitionsCreated, "today and tomorrow")

	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM events`).Scan(&n))
	require.Equal(t, 10, n, "the kept partition's rows, all of them")
	var parts []string
	rows, err := s.DB.Query(`SELECT c.relname || ':' || coalesce(array_to_string(c.reloptions, ','), '') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'events'::regclass ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		parts = append(parts, p)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{
		"events_default:",
		revived + ":",
		PartitionName("events", today) + ":fillfactor=90",
		PartitionName("events", today.AddDate(0, 0, 1)) + ":fillfactor=90",
	}, parts)
}

func TestPartitionRound_PlainTableIsDeletedFrom(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	_, err := s.DB.Exec(`CREATE TABLE events (id BIGSERIAL PRIMARY KEY, done BOOLEAN NOT NULL, at TIMESTAMPTZ NOT NULL);
		INSERT INTO events (done, at) SELECT true, now() - interval '2 days' FROM generate_series(1, 5)`)
	require.NoError(t, err)
	c, err := New(storage.NewSQLPool(s.DB), events, Config{Retention: time.Millisecond})
	require.NoError(t, err)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 5, stats.Deleted, "a table with a partition mode that is not partitioned is cleaned by DELETE")
	require.Zero(t, stats.PartitionsCreated)
}

func TestConfig_PartitionsAhead(t *testing.T) {
	t.Parallel()
	var c Config
	c.setDefaults(events)
	require.Equal(t, DefaultPartitionsAhead, c.PartitionsAhead)
	for _, bad := range []int{-1, MaxPartitionsAhead + 1} {
		c.PartitionsAhead = bad
		err := c.validate(events)
		require.Error(t, err)
		require.True(t, strings.Contains(err.Error(), "PartitionsAhead"), err.Error())
	}
}
