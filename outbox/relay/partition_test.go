package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

// partitionedSubtest marks the subtests of TestOutboxLayouts that run a
// test on the partitioned layout; MILLWRIGHT_TEST_OUTBOX_LAYOUT=partitioned
// runs every test of the package on it.
const partitionedSubtest = "partitioned-layout"

// layoutMigrations returns the migrations setup applies: the plain layout,
// or the partitioned one in TestOutboxLayouts' subtests (or with
// MILLWRIGHT_TEST_OUTBOX_LAYOUT=partitioned).
func layoutMigrations(t *testing.T) []migrate.Source {
	if strings.Contains(t.Name(), "/"+partitionedSubtest) || os.Getenv("MILLWRIGHT_TEST_OUTBOX_LAYOUT") == "partitioned" {
		return []migrate.Source{outbox.Migrations(), outbox.PartitionedMigrations()}
	}
	return []migrate.Source{outbox.Migrations()}
}

// TestOutboxLayouts runs the relay's ordering, crash, at-least-once,
// failure and wake-up tests again on the partitioned layout: Add and the
// Relay must work unchanged on it.
func TestOutboxLayouts(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"CommittedEventsArePublished", TestRelay_CommittedEventsArePublished},
		{"ListenWakesWithoutPolling", TestRelay_ListenWakesWithoutPolling},
		{"KilledBetweenPublishAndMarkRepublishes", TestRelay_KilledBetweenPublishAndMarkRepublishes},
		{"PerAggregateOrderWithConcurrentRelays", TestRelay_PerAggregateOrderWithConcurrentRelays},
		{"BatchPublisherKeepsOrder", TestRelay_BatchPublisherKeepsOrder},
		{"PoisonRowFailsWhileOthersFlow", TestRelay_PoisonRowFailsWhileOthersFlow},
		{"NoLostWakeupForWriterInFlight", TestRelay_NoLostWakeupForWriterInFlight},
		{"TriggerNotifiesOnlyWhileARelayWaits", TestTrigger_NotifiesOnlyWhileARelayWaits},
		{"FailingAggregateBacklogDoesNotBlockOthers", TestRelay_FailingAggregateBacklogDoesNotBlockOthers},
		{"AddRollbackLeavesNothing", TestAdd_RollbackLeavesNothing},
	} {
		t.Run(partitionedSubtest+"/"+tc.name, func(t *testing.T) {
			b := setup(t)
			require.Equal(t, "p", relkind(t, b.db), "the subtest must run on the partitioned table")
			tc.f(t)
		})
	}
}

func relkind(t *testing.T, db *sql.DB) string {
	t.Helper()
	var k string
	require.NoError(t, db.QueryRow(`SELECT relkind FROM pg_class WHERE oid = 'millwright_outbox'::regclass`).Scan(&k))
	return k
}

// objectDefs returns the definitions of the indexes (but the primary key)
// and triggers of millwright_outbox, schema names removed.
func objectDefs(t *testing.T, s *pgtest.Schema) []string {
	t.Helper()
	defs := pgtest.Column[string](t, s.DB, `SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'millwright_outbox'::regclass AND NOT indisprimary
		UNION ALL SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = 'millwright_outbox'::regclass AND NOT tgisinternal`)
	for i, d := range defs {
		d = strings.ReplaceAll(d, s.Name+".", "")
		defs[i] = strings.ReplaceAll(d, " ON ONLY ", " ON ")
	}
	sort.Strings(defs)
	return defs
}

func TestPartitioned_SameIndexesAndTriggers(t *testing.T) {
	t.Parallel()
	plain := pgtest.New(t, outbox.Migrations())
	part := pgtest.New(t, outbox.Migrations(), outbox.PartitionedMigrations())
	require.Equal(t, "r", relkind(t, plain.DB))
	require.Equal(t, "p", relkind(t, part.DB))

	want := objectDefs(t, plain)
	require.NotEmpty(t, want)
	require.Equal(t, want, objectDefs(t, part), "every index and trigger of the plain table, lane, backoff and wake-up included")
	for _, d := range want {
		t.Log(d)
	}

	var pk string
	require.NoError(t, part.DB.QueryRow(`SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'millwright_outbox'::regclass AND contype = 'p'`).Scan(&pk))
	require.Equal(t, "PRIMARY KEY (id, created_at)", pk)

	var parts []string
	rows, err := part.DB.Query(`SELECT c.relname || ' ' || pg_get_expr(c.relpartbound, c.oid) || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'millwright_outbox'::regclass ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		parts = append(parts, p)
	}
	require.NoError(t, rows.Err())
	require.Len(t, parts, 5, "before-today, today, +1, +2, default: %v", parts)
	for _, p := range parts {
		require.Contains(t, p, "fillfactor=70")
	}
	require.Contains(t, strings.Join(parts, "\n"), "millwright_outbox_default DEFAULT")

	// A write of any date finds a partition.
	_, err = part.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, created_at) VALUES
		('past', 't', 'a', '{}', now() - interval '400 days'), ('future', 't', 'a', '{}', now() + interval '400 days')`)
	require.NoError(t, err)
}

// TestPartitioned_MigrateWithPendingRows converts a plain outbox holding
// published, pending (some due long ago), failed and backing-off rows
// while writers write and a relay publishes, and checks that every event
// is published exactly once and in order per aggregate, that ids and the
// sequence are kept, and that the failed row stays failed.
func TestPartitioned_MigrateWithPendingRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, "r", relkind(t, b.db))
	ctx := context.Background()
	got := b.collect(t, "mig")
	seedBeforePartitioning(ctx, t, b)

	// During: a relay publishes and writers write while the table is
	// converted. The relay's wake-up is keyed by the old table's oid, so
	// after the conversion it polls (20 ms).
	startRelay(t, b.db, b.pubsub, Config{PollInterval: 20 * time.Millisecond, BatchSize: 10})
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var written [3]int
	startMigrationWriters(ctx, t, b.db, &wg, stop, &written)
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "true") > 260 }, "writers write")
	before := outboxIDs(t, b.db)
	var maxBefore int64
	for x := range before {
		maxBefore = max(maxBefore, x.id)
	}
	applied, err := migrate.Up(ctx, postgres.From(b.db), outbox.Migrations(), outbox.PartitionedMigrations())
	require.NoError(t, err)
	require.Len(t, applied, 1)
	require.Equal(t, "p", relkind(t, b.db))
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "id > "+strconv.FormatInt(maxBefore+100, 10)) > 0 }, "writers write after the conversion")
	close(stop)
	wg.Wait()

	after := outboxIDs(t, b.db)
	for x := range before {
		require.True(t, after[x], "row %d (%s) kept with its id", x.id, x.ev)
	}
	total := 200 + written[0] + written[1] + written[2]
	require.Equal(t, total+1, len(after), "every row, nothing duplicated")
	eventually(t, 20*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "the relay drains the partitioned table")
	require.Equal(t, 1, count(t, b.db, "status = 'failed' AND event_id = 'failed-1'"), "the failed row stays failed")
	var oldPending int
	require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE created_at < now() - interval '2 days'`).Scan(&oldPending))
	require.Equal(t, 20, oldPending, "the old rows moved too")

	eventually(t, 30*time.Second, func() bool { return len(got.all()) == total }, "every event published")
	requireOncePerEventInAggregateOrder(t, got.all())
	var lastID int64
	require.NoError(t, b.db.QueryRow(`SELECT max(id) FROM millwright_outbox`).Scan(&lastID))
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "mig", AggregateID: "z"}))
	var newID int64
	require.NoError(t, b.db.QueryRow(`SELECT id FROM millwright_outbox WHERE aggregate_id = 'z'`).Scan(&newID))
	require.Greater(t, newID, lastID, "the sequence goes on")
}

// seedBeforePartitioning writes 200 rows, 50 of them published by a relay
// round, one failed, 20 pending and created 3 days ago (they move to the
// partition of rows older than today).
func seedBeforePartitioning(ctx context.Context, t *testing.T, b bundle) {
	for i := range 200 {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "mig", AggregateID: "a" + strconv.Itoa(i%10), Payload: []byte(fmt.Sprintf(`{"agg":"a%d","seq":%d}`, i%10, i/10))}))
	}
	_, err := b.db.Exec(`UPDATE millwright_outbox SET created_at = now() - interval '3 days' WHERE id IN (SELECT id FROM millwright_outbox ORDER BY id DESC LIMIT 20)`)
	require.NoError(t, err)
	first, err := New(postgres.From(b.db), b.pubsub, Config{BatchSize: 50})
	require.NoError(t, err)
	n, err := first.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 50, n)
	_, err = b.db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, last_error) VALUES ('failed-1', 'mig-failed', 'f', '{}', 'failed', 'boom')`)
	require.NoError(t, err)
	require.Equal(t, 150, count(t, b.db, "status = 'pending'"))
}

// outboxIDEvent is a row's id and event id.
type outboxIDEvent struct {
	id int64
	ev string
}

// outboxIDs is the set of the outbox's rows.
func outboxIDs(t *testing.T, db *sql.DB) map[outboxIDEvent]bool {
	rows, err := db.Query(`SELECT id, event_id FROM millwright_outbox`)
	require.NoError(t, err)
	defer rows.Close()
	m := map[outboxIDEvent]bool{}
	for rows.Next() {
		var x outboxIDEvent
		require.NoError(t, rows.Scan(&x.id, &x.ev))
		m[x] = true
	}
	require.NoError(t, rows.Err())
	return m
}

// startMigrationWriters starts three writers, each adding events of its
// own aggregate (w0..w2) in sequence until stop closes, counting them in
// written.
func startMigrationWriters(ctx context.Context, t *testing.T, db *sql.DB, wg *sync.WaitGroup, stop <-chan struct{}, written *[3]int) {
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				agg := fmt.Sprintf("w%d", w)
				if err := outbox.AddOutsideTx(ctx, postgres.From(db), outbox.Event{Topic: "mig", AggregateID: agg, Payload: []byte(fmt.Sprintf(`{"agg":%q,"seq":%d}`, agg, i))}); err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				written[w]++
			}
		}()
	}
}

// requireOncePerEventInAggregateOrder: no event published twice, and each
// aggregate's seq counts up from 0.
func requireOncePerEventInAggregateOrder(t *testing.T, msgs []*message.Message) {
	seen := map[string]bool{}
	last := map[string]int{}
	for _, m := range msgs {
		require.False(t, seen[m.UUID], "event %s published twice", m.UUID)
		seen[m.UUID] = true
		var p struct {
			Agg string
			Seq int
		}
		require.NoError(t, json.Unmarshal(m.Payload, &p))
		if prev, ok := last[p.Agg]; ok {
			require.Equal(t, prev+1, p.Seq, "aggregate %s out of order", p.Agg)
		} else {
			require.Equal(t, 0, p.Seq, "aggregate %s starts at 0", p.Agg)
		}
		last[p.Agg] = p.Seq
	}
}

// partitionedSetup returns an empty partitioned outbox whose partitions
// are the days from today-3 to today and the DEFAULT one.
func partitionedSetup(t *testing.T) (bundle, time.Time) {
	t.Helper()
	s := pgtest.New(t, outbox.Migrations(), outbox.PartitionedMigrations())
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100000, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	b := bundle{db: s.DB, schema: s, pubsub: ps}
	var today time.Time
	require.NoError(t, b.db.QueryRow(`SELECT date_trunc('day', now() AT TIME ZONE 'UTC')::timestamp`).Scan(&today))
	today = time.Date(today.Year(), today.Month(), today.Day(), 0, 0, 0, 0, time.UTC)
	var before string
	require.NoError(t, b.db.QueryRow(`SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'millwright_outbox'::regclass AND c.relname LIKE 'millwright_outbox_pbefore_%'`).Scan(&before))
	_, err := b.db.Exec(`DROP TABLE ` + before)
	require.NoError(t, err)
	for d := -3; d < 0; d++ {
		day := today.AddDate(0, 0, d)
		_, err := b.db.Exec(fmt.Sprintf(`CREATE TABLE %s PARTITION OF millwright_outbox FOR VALUES FROM ('%s') TO ('%s') WITH (fillfactor = 70)`,
			retention.PartitionName("millwright_outbox", day), day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339)))
		require.NoError(t, err)
	}
	return b, today
}

func partitionNames(t *testing.T, db *sql.DB) []string {
	t.Helper()
	return pgtest.Column[string](t, db, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'millwright_outbox'::regclass ORDER BY 1`)
}

func TestPartitionCleaner_CreatesAheadDropsOnlyFullyPublishedPartitions(t *testing.T) {
	t.Parallel()
	b, today := partitionedSetup(t)
	ctx := context.Background()
	pname := func(d int) string { return retention.PartitionName("millwright_outbox", today.AddDate(0, 0, d)) }

	// Day -3: published only. Day -2: published and one pending. Day -1:
	// published and one failed. Today: published. The future: one row in
	// the DEFAULT partition (the cleaner has not run yet).
	seedPartitionDays(t, b.db, today)

	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{Retention: time.Millisecond, PartitionsAhead: 4})
	require.NoError(t, err)
	dry, err := c.Count(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 100, dry, "the dry run counts the rows of day -3 only")

	stats, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, stats.PartitionsCreated, "today+3 and today+4 (today..+2 came with the migration)")
	require.Equal(t, 1, stats.PartitionsDropped)
	require.EqualValues(t, 100, stats.DroppedRows)
	require.Len(t, stats.PartitionsKept, 2)
	require.Contains(t, stats.PartitionsKept[0], pname(-2)+" (1 rows")
	require.Contains(t, stats.PartitionsKept[1], pname(-1)+" (1 rows")
	require.EqualValues(t, 1, stats.DefaultRows, "the row of 30 days ahead")
	require.Zero(t, stats.Deleted, "nothing deleted row by row")

	names := partitionNames(t, b.db)
	require.NotContains(t, names, pname(-3))
	for d := -2; d <= 4; d++ {
		require.Contains(t, names, pname(d))
	}
	require.Equal(t, 0, count(t, b.db, "created_at < '"+today.AddDate(0, 0, -2).Format(time.RFC3339)+"'"))
	require.Equal(t, 1, count(t, b.db, "event_id = 'pending-old' AND status = 'pending'"), "the pending row is kept")
	require.Equal(t, 1, count(t, b.db, "event_id = 'failed-old'"), "the failed row is kept")

	requireLikeTheOtherPartitions(t, b.db, pname(4))

	// Once the pending row is published, its partition goes; nothing to
	// create any more. The failed one stays until retried or removed.
	_, err = b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE event_id = 'pending-old'`)
	require.NoError(t, err)
	stats, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, stats.PartitionsCreated)
	require.Equal(t, 1, stats.PartitionsDropped)
	require.Len(t, stats.PartitionsKept, 1)
	require.NotContains(t, partitionNames(t, b.db), pname(-2))

	// One instance at a time: a round finding the lock held skips.
	conn, err := b.db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	var locked bool
	require.NoError(t, conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock(`+strconv.Itoa(int(storage.OutboxRetention.LockClass))+`, hashtext(current_schema()))`).Scan(&locked))
	require.True(t, locked)
	stats, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, stats.Skipped)
	_, err = conn.ExecContext(ctx, `SELECT pg_advisory_unlock_all()`)
	require.NoError(t, err)
}

// seedPartitionDays writes 100 published rows on each of days -3..0 from
// today, a pending row on day -2, a failed one on day -1 and a pending one
// 30 days ahead.
func seedPartitionDays(t *testing.T, db *sql.DB, today time.Time) {
	_, err := db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, published_at, created_at)
		SELECT 'e' || d || '-' || g, 't', 'a', '{}', 'published', now(), $1::timestamptz + (d * interval '1 day') + interval '1 hour'
		FROM generate_series(-3, 0) d, generate_series(1, 100) g`, today)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, created_at) VALUES
		('pending-old', 't', 'p', '{}', 'pending', $1::timestamptz - interval '2 days' + interval '2 hours'),
		('failed-old', 't', 'f', '{}', 'failed', $1::timestamptz - interval '1 day' + interval '2 hours'),
		('future', 't', 'x', '{}', 'pending', now() + interval '30 days')`, today)
	require.NoError(t, err)
	_, err = db.Exec(`ANALYZE millwright_outbox`)
	require.NoError(t, err)
}

// requireLikeTheOtherPartitions: a new partition is like the others: the
// relay's indexes, the storage parameters.
func requireLikeTheOtherPartitions(t *testing.T, db *sql.DB, partition string) {
	var idx int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_index WHERE indrelid = $1::regclass`, partition).Scan(&idx))
	var parentIdx int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_index WHERE indrelid = 'millwright_outbox'::regclass`).Scan(&parentIdx))
	require.Equal(t, parentIdx, idx)
	var opts string
	require.NoError(t, db.QueryRow(`SELECT array_to_string(reloptions, ',') FROM pg_class WHERE oid = $1::regclass`, partition).Scan(&opts))
	require.Equal(t, "fillfactor=70", opts)
}

func TestPartitionCleaner_ConflictWithDefaultRowsIsReported(t *testing.T) {
	t.Parallel()
	b, today := partitionedSetup(t)
	ctx := context.Background()
	// A row dated 5 days ahead lands in DEFAULT before its partition
	// exists; the cleaner then cannot attach that day's partition.
	_, err := b.db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, created_at) VALUES ('ahead', 't', 'a', '{}', $1::timestamptz + interval '5 days 1 hour')`, today)
	require.NoError(t, err)
	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{Retention: 30 * 24 * time.Hour, PartitionsAhead: 6})
	require.NoError(t, err)
	stats, err := c.RunOnce(ctx)
	require.Error(t, err)
	require.Contains(t, err.Error(), retention.PartitionName("millwright_outbox", today.AddDate(0, 0, 5)))
	require.Contains(t, err.Error(), "DEFAULT partition holds rows of that day")
	require.Equal(t, 3, stats.PartitionsCreated, "+3, +4 and +6 still created")
	require.EqualValues(t, 1, stats.DefaultRows)
	require.Equal(t, 1, count(t, b.db, "event_id = 'ahead'"), "the row is still there and claimable")
}

// claimBuffers returns the shared buffers (hit + read) one claim over
// every lane touches, from EXPLAIN (ANALYZE, BUFFERS).
func claimBuffers(t *testing.T, db *sql.DB) int {
	t.Helper()
	all := allLanes()
	q := strings.NewReplacer("$1", "'"+intArrayParam(all)+"'", "$2", "100", "$3", "'"+intArrayParam(equalShares(100, all))+"'").Replace(claimSQL)
	var plan string
	require.NoError(t, db.QueryRow(`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) `+q).Scan(&plan))
	var p []struct {
		Plan map[string]any
	}
	require.NoError(t, json.Unmarshal([]byte(plan), &p))
	hit, _ := p[0].Plan["Shared Hit Blocks"].(float64)
	read, _ := p[0].Plan["Shared Read Blocks"].(float64)
	return int(hit + read)
}

// TestClaim_FlatOverPublishedRows is the plan-shape check that the claim
// does not grow with published rows, on both layouts: the buffers one
// claim of 64 lanes touches with 50,000 published rows are within a few of
// those on an empty table (one index page per lane). The rows are written published, which is the
// table once (auto)vacuum has removed the pending indexes' entries of
// published rows: until then each claim reads those dead entries (a row
// published and not yet vacuumed costs the claim; see
// docs/partitioning.md on autovacuum). Vacuum is not run here because a
// transaction elsewhere on the shared server can hold it back. `millwright-bench outbox --sections claim,retention`
// measures the time at 1,000,000 rows.
func TestClaim_FlatOverPublishedRows(t *testing.T) {
	t.Parallel()
	// MILLWRIGHT_TEST_CLAIM_ROWS=1000000 measures at a million rows.
	n := 50000
	if v, err := strconv.Atoi(os.Getenv("MILLWRIGHT_TEST_CLAIM_ROWS")); err == nil && v > 0 {
		n = v
	}
	for _, layout := range []string{"plain", partitionedSubtest} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			empty := claimBuffers(t, b.db)
			_, err := b.db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, payload, status, published_at)
				SELECT 'e' || g, 't', 'order', (g % 5000)::text, '{}', 'published', now() FROM generate_series(1, $1::int) g`, n)
			require.NoError(t, err)
			_, err = b.db.Exec(`ANALYZE millwright_outbox`)
			require.NoError(t, err)
			full := claimBuffers(t, b.db)
			t.Logf("%s: claim buffers %d empty, %d with %d published rows", layout, empty, full, n)
			// An empty partial index may have no page to read; a filled
			// table adds at most its root page per lane (64).
			require.LessOrEqual(t, full, empty+2*64, "the claim reads the pending indexes only")
		})
	}
}

// TestPartitionCleaner_WithRelayAndWriters: cleaner rounds run while a
// relay publishes and writers write on the partitioned layout, and old
// partitions hold pending rows. Every event is published exactly once;
// the old partitions go once their rows are published, not before.
func TestPartitionCleaner_WithRelayAndWriters(t *testing.T) {
	t.Parallel()
	b, today := partitionedSetup(t)
	b.db.SetMaxOpenConns(8)
	got := b.collect(t, "old")
	ctx := context.Background()

	// Days -3..-1: 100 rows each; day -2's are published already.
	_, err := b.db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, published_at, created_at)
		SELECT 'old-' || d || '-' || g, 'old', 'agg-' || (g % 5), '{}',
			CASE WHEN d = -2 THEN 'published' ELSE 'pending' END, CASE WHEN d = -2 THEN now() END,
			$1::timestamptz + d * interval '1 day' + g * interval '1 second'
		FROM generate_series(-3, -1) d, generate_series(1, 100) g`, today)
	require.NoError(t, err)

	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{Retention: time.Millisecond, PartitionsAhead: 2})
	require.NoError(t, err)
	// Before the relay runs: only day -2 may go.
	stats, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, stats.PartitionsDropped)
	require.Len(t, stats.PartitionsKept, 2)

	startRelay(t, b.db, b.pubsub, Config{PollInterval: 20 * time.Millisecond, BatchSize: 7})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written [2]int
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "old", AggregateID: fmt.Sprintf("w%d", w)}); err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				written[w]++
			}
		}()
	}
	dropped := stats.PartitionsDropped
	eventually(t, 20*time.Second, func() bool {
		st, err := c.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, st.DefaultRows)
		dropped += st.PartitionsDropped
		return dropped == 3
	}, "the old partitions go once the relay has published their rows")
	close(stop)
	wg.Wait()
	total := 200 + written[0] + written[1]
	eventually(t, 20*time.Second, func() bool { return len(got.all()) == total }, "every event published")
	seen := map[string]bool{}
	for _, m := range got.all() {
		require.False(t, seen[m.UUID], "event %s published twice", m.UUID)
		seen[m.UUID] = true
	}
	// A message reaches the subscriber before the relay marks its row.
	eventually(t, 30*time.Second, func() bool { return count(t, b.db, "status = 'pending'") == 0 }, "every row marked published")
	for d := -3; d < 0; d++ {
		require.NotContains(t, partitionNames(t, b.db), retention.PartitionName("millwright_outbox", today.AddDate(0, 0, d)))
	}
}
