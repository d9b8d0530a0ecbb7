package outboxbench

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

// SectionRetention is the retention section: removing Config.PublishedRows
// published rows by the cleaner's batched DELETE (the plain layout) and by
// dropping partitions (outbox.PartitionedMigrations), the writers'
// transaction rate while it happens, and a relay round with nothing due
// on each layout empty and holding the rows.
const SectionRetention = "retention"

// retentionWriters write one-event transactions throughout a removal.
const retentionWriters = 4

// retentionDays is how many past days the published rows are spread over
// (one partition each on the partitioned layout).
const retentionDays = 10

// outboxSizeSQL is the bytes of the outbox, indexes included, of either
// layout (a partitioned table's own size is 0: its partitions hold it).
const outboxSizeSQL = `SELECT CASE WHEN c.relkind = 'p'
	THEN (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(c.oid))
	ELSE pg_total_relation_size(c.oid) END::int8
	FROM pg_class c WHERE c.oid = 'millwright_outbox'::regclass`

// retentionRun is one removal on one layout.
type retentionRun struct {
	remove       time.Duration
	txBefore     float64 // writers' tx/s in the second before
	txDuring     float64 // writers' tx/s from the start of the removal over max(removal, 1 s)
	maxTxDuring  time.Duration
	deadTuples   int64 // n_dead_tup of the outbox after the removal
	sizeBefore   int64 // bytes, table and indexes, before the removal
	sizeAfter    int64 // and after
	claimEmpty   time.Duration
	claimLoaded  time.Duration
	droppedParts int
}

func (b *bench) benchRetention(ctx context.Context, rows int) error {
	var plain, part []retentionRun
	for i := range b.Rounds {
		b.Progress("retention round %d/%d: DELETE on the plain layout ...", i+1, b.Rounds)
		r, err := b.retentionRound(ctx, false, rows, i)
		if err != nil {
			return fmt.Errorf("DELETE: %w", err)
		}
		plain = append(plain, r)
		b.Progress("retention round %d/%d: dropping partitions ...", i+1, b.Rounds)
		r, err = b.retentionRound(ctx, true, rows, i)
		if err != nil {
			return fmt.Errorf("partitions: %w", err)
		}
		part = append(part, r)
	}
	pick := func(rs []retentionRun, f func(retentionRun) float64) (float64, []float64) {
		xs := make([]float64, len(rs))
		for i, r := range rs {
			xs[i] = f(r)
		}
		return median(xs), xs
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	delTime, delRuns := pick(plain, func(r retentionRun) float64 { return ms(r.remove) })
	dropTime, dropRuns := pick(part, func(r retentionRun) float64 { return ms(r.remove) })
	b.emit(Row{Case: "retention", Variant: fmt.Sprintf("remove %d published rows: batched DELETE (cleaner, %d rows/batch)", rows, retention.DefaultBatchSize),
		Value: delTime, Unit: "ms", Runs: delRuns})
	b.emit(Row{Case: "retention", Variant: fmt.Sprintf("remove %d published rows: detach and drop %d daily partitions", rows, retentionDays),
		Value: dropTime, Unit: "ms", Baseline: delTime, Ratio: dropTime / delTime, Runs: dropRuns})
	for _, l := range []struct {
		name string
		rs   []retentionRun
	}{{"DELETE", plain}, {"partition drop", part}} {
		before, _ := pick(l.rs, func(r retentionRun) float64 { return r.txBefore })
		during, runs := pick(l.rs, func(r retentionRun) float64 { return r.txDuring })
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("%d writers' tx/s during the %s (baseline: the second before)", retentionWriters, l.name),
			Value: during, Unit: "tx/s", Baseline: before, Ratio: during / before, Runs: runs})
		worst, runs := pick(l.rs, func(r retentionRun) float64 { return ms(r.maxTxDuring) })
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("slowest writer tx during the %s", l.name), Value: worst, Unit: "ms", Runs: runs})
		sb, _ := pick(l.rs, func(r retentionRun) float64 { return float64(r.sizeBefore) / (1 << 20) })
		sa, runs := pick(l.rs, func(r retentionRun) float64 { return float64(r.sizeAfter) / (1 << 20) })
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("outbox size (table and indexes) after the %s (baseline: before)", l.name), Value: sa, Unit: "MiB",
			Baseline: sb, Ratio: sa / sb, Runs: runs})
		dead, runs := pick(l.rs, func(r retentionRun) float64 { return float64(r.deadTuples) })
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("dead tuples left for vacuum after the %s", l.name), Value: dead, Unit: "rows", Runs: runs})
		c0, runs0 := pick(l.rs, func(r retentionRun) float64 { return ms(r.claimEmpty) })
		c1, runs1 := pick(l.rs, func(r retentionRun) float64 { return ms(r.claimLoaded) })
		layout := "plain"
		if l.name != "DELETE" {
			layout = "partitioned"
		}
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("relay round, nothing due, %s layout, empty", layout), Value: c0, Unit: "ms", Runs: runs0})
		b.emit(Row{Case: "retention", Variant: fmt.Sprintf("relay round, nothing due, %s layout, %d published rows", layout, rows), Value: c1, Unit: "ms",
			Baseline: c0, Ratio: c1 / c0, Target: "<= 1.5x", Runs: runs1})
	}
	return nil
}

// retentionRound fills a fresh outbox of one layout with rows published
// rows spread over the past retentionDays days and times the cleaner
// removing them while writers write.
func (b *bench) retentionRound(ctx context.Context, partitioned bool, rows, round int) (retentionRun, error) {
	var run retentionRun
	suffix := fmt.Sprintf("ret%d_plain", round)
	if partitioned {
		suffix = fmt.Sprintf("ret%d_part", round)
	}
	db, err := b.sibling(ctx, suffix)
	if err != nil {
		return run, err
	}
	defer db.Close()
	db.SetMaxOpenConns(retentionWriters + 4)
	if partitioned {
		if err := partitionPastDays(ctx, db); err != nil {
			return run, err
		}
	}
	warm, err := retention.NewOutboxCleaner(postgres.From(db), retention.Config{Retention: 365 * 24 * time.Hour})
	if err != nil {
		return run, err
	}
	if run.claimEmpty, err = idleRound(ctx, db); err != nil {
		return run, err
	}
	if err := fillPublished(ctx, db, rows, b.payload); err != nil {
		return run, err
	}
	if run.claimLoaded, err = idleRound(ctx, db); err != nil {
		return run, err
	}
	// The partitions ahead, which a cleaner running daily has long made,
	// are not part of the removal timed below.
	if _, err := warm.RunOnce(ctx); err != nil {
		return run, err
	}
	if err := db.QueryRowContext(ctx, outboxSizeSQL).Scan(&run.sizeBefore); err != nil {
		return run, err
	}
	// Autovacuum would clear the DELETE's dead tuples before they are
	// counted, whenever it happens to run: off for this scratch outbox's
	// tables, so the count is what the removal leaves for vacuum.
	if err := autovacuumOff(ctx, db); err != nil {
		return run, err
	}

	w := startWriters(ctx, db, b.payload)
	time.Sleep(time.Second) // the baseline window: writers alone
	c, err := retention.NewOutboxCleaner(postgres.From(db), retention.Config{Retention: time.Millisecond})
	if err != nil {
		_ = w.halt()
		return run, err
	}
	start := time.Now()
	stats, err := c.RunOnce(ctx)
	run.remove = time.Since(start)
	window := max(run.remove, time.Second)
	if rest := time.Until(start.Add(window)); rest > 0 {
		time.Sleep(rest) // writers go on to the end of the measured window
	}
	if werr := w.halt(); werr != nil {
		return run, fmt.Errorf("writer: %w", werr)
	}
	if err != nil {
		return run, err
	}
	if removed := stats.Deleted + stats.DroppedRows; removed < int64(rows)*9/10 {
		return run, fmt.Errorf("the cleaner removed %d rows of %d (stats %+v)", removed, rows, stats)
	}
	run.txBefore, run.txDuring, run.maxTxDuring = w.rates(start, window)
	run.droppedParts = stats.PartitionsDropped
	// The table's size after: the DELETE returns no space (vacuum makes
	// it reusable later); dropped partitions return theirs at once.
	// pg_partition_tree sums the partitions of the partitioned layout.
	if err := db.QueryRowContext(ctx, outboxSizeSQL).Scan(&run.sizeAfter); err != nil {
		return run, err
	}
	// n_dead_tup is what the DELETE left for vacuum. A session reports
	// its counts when idle, at most once a second, or when it exits:
	// closing the idle connections (the cleaner's among them) makes them
	// report.
	db.SetMaxIdleConns(0)
	if run.deadTuples, err = settledDeadTuples(ctx, db, run.remove > 0 && stats.Deleted > 0); err != nil {
		return run, err
	}
	return run, nil
}

// settledDeadTuples reads n_dead_tup of the outbox's tables until the
// sessions' reports have arrived: two reads 300 ms apart that agree, and,
// when rows were deleted (expectSome), not zero; at most 30 s, then the
// last read. A session that stays open reports its counts after 10 s idle
// (Postgres 15's PGSTAT_IDLE_INTERVAL), so 15 s left a loaded server 5 s:
// a fresh-clone CI run read 0 after the DELETE's 5,000 dead tuples.
func settledDeadTuples(ctx context.Context, db *sql.DB, expectSome bool) (int64, error) {
	const q = `SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_user_tables
		WHERE relid IN (SELECT relid FROM pg_partition_tree('millwright_outbox') UNION SELECT 'millwright_outbox'::regclass)`
	deadline := time.Now().Add(30 * time.Second)
	last := int64(-1)
	for {
		var n int64
		if err := db.QueryRowContext(ctx, q).Scan(&n); err != nil {
			return 0, err
		}
		if (n == last && (n > 0 || !expectSome)) || time.Now().After(deadline) {
			return n, nil
		}
		last = n
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// autovacuumOff turns autovacuum off for every table holding the
// outbox's rows (the table itself, or each partition).
func autovacuumOff(ctx context.Context, db *sql.DB) error {
	rows, err := db.QueryContext(ctx, `SELECT relid::regclass::text FROM pg_partition_tree('millwright_outbox') WHERE isleaf`)
	if err != nil {
		return fmt.Errorf("listing the outbox's tables: %w", err)
	}
	var tables []string
	for rows.Next() {
		var t string
		if err := rows.Scan(&t); err != nil {
			rows.Close()
			return err
		}
		tables = append(tables, t)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, t := range tables {
		if _, err := db.ExecContext(ctx, `ALTER TABLE `+t+` SET (autovacuum_enabled = off)`); err != nil {
			return fmt.Errorf("turning autovacuum off for %s: %w", t, err)
		}
	}
	return nil
}

// partitionPastDays converts the sibling's outbox to the partitioned
// layout and gives it one partition per past day instead of the one
// partition of everything before today that the migration creates.
func partitionPastDays(ctx context.Context, db *sql.DB) error {
	if _, err := migrate.Up(ctx, postgres.From(db), outbox.Migrations(), outbox.PartitionedMigrations()); err != nil {
		return err
	}
	var before string
	if err := db.QueryRowContext(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'millwright_outbox'::regclass AND c.relname LIKE 'millwright_outbox_pbefore_%'`).Scan(&before); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `DROP TABLE `+before); err != nil {
		return err
	}
	var today time.Time
	if err := db.QueryRowContext(ctx, `SELECT date_trunc('day', now() AT TIME ZONE 'UTC')::timestamp`).Scan(&today); err != nil {
		return err
	}
	today = time.Date(today.Year(), today.Month(), today.Day(), 0, 0, 0, 0, time.UTC)
	for d := -retentionDays - 1; d < 0; d++ {
		day := today.AddDate(0, 0, d)
		if _, err := db.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF millwright_outbox FOR VALUES FROM ('%s') TO ('%s') WITH (fillfactor = 70)`,
			retention.PartitionName("millwright_outbox", day), day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339))); err != nil {
			return err
		}
	}
	return nil
}

// idleRound is the median of 50 relay rounds with nothing due.
func idleRound(ctx context.Context, db *sql.DB) (time.Duration, error) {
	r, err := relay.New(postgres.From(db), discardPublisher{}, relay.Config{BatchSize: 100})
	if err != nil {
		return 0, err
	}
	xs := make([]time.Duration, 0, 50)
	for range 50 {
		start := time.Now()
		if _, err := r.RunOnce(ctx); err != nil {
			return 0, err
		}
		xs = append(xs, time.Since(start))
	}
	return time.Duration(medianDur(xs) * float64(time.Millisecond)), nil
}

// fillPublished inserts rows published rows spread over the past
// retentionDays UTC days and vacuums the table, as a cleaner that runs
// daily finds it.
func fillPublished(ctx context.Context, db *sql.DB, rows int, payload []byte) error {
	if _, err := db.ExecContext(ctx, `INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, status, created_at, published_at)
		SELECT 'bench-' || g, 'bench_retention', 'order', (g % 100000)::text, 'order.created.v1', $2::jsonb, 'published',
			(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') - ((1 + g % $3::int) * interval '1 day') + interval '1 hour',
			(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') - ((1 + g % $3::int) * interval '1 day') + interval '1 hour'
		FROM generate_series(1, $1::int) g`, rows, string(payload), retentionDays); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `VACUUM ANALYZE millwright_outbox`); err != nil {
		return err
	}
	return nil
}

// writers write one outbox event per transaction and time each commit.
type writers struct {
	stop    atomic.Bool
	wg      sync.WaitGroup
	mu      sync.Mutex
	commits []commit
	err     error
}

type commit struct {
	at  time.Time
	dur time.Duration
}

// startWriters starts retentionWriters writers and returns once each has
// made its first attempt.
func startWriters(ctx context.Context, db *sql.DB, payload []byte) *writers {
	w := &writers{}
	var first sync.WaitGroup
	for n := range retentionWriters {
		w.wg.Add(1)
		first.Add(1)
		go func() {
			defer w.wg.Done()
			for i := 0; !w.stop.Load(); i++ {
				start := time.Now()
				err := outbox.AddOutsideTx(ctx, postgres.From(db), outbox.Event{Topic: "bench_retention", AggregateType: "order", AggregateID: fmt.Sprintf("w%d-%d", n, i), Payload: payload})
				end := time.Now()
				w.mu.Lock()
				if err != nil && w.err == nil {
					w.err = err
				}
				if err == nil {
					w.commits = append(w.commits, commit{at: end, dur: end.Sub(start)})
				}
				w.mu.Unlock()
				if i == 0 {
					first.Done()
				}
				if err != nil {
					return
				}
			}
		}()
	}
	first.Wait()
	return w
}

// halt stops the writers and returns the first error one met.
func (w *writers) halt() error {
	w.stop.Store(true)
	w.wg.Wait()
	return w.err
}

// rates are the commits per second in the second before start and over
// window from start, and the slowest transaction of the latter.
func (w *writers) rates(start time.Time, window time.Duration) (before, during float64, worst time.Duration) {
	var nb, nd int
	for _, cm := range w.commits {
		switch {
		case cm.at.Before(start) && cm.at.After(start.Add(-time.Second)):
			nb++
		case !cm.at.Before(start) && cm.at.Before(start.Add(window)):
			nd++
			worst = max(worst, cm.dur)
		}
	}
	return float64(nb), float64(nd) / window.Seconds(), worst
}
