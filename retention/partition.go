package retention

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/internal/storage"
)

// Partition mode defaults.
const (
	// DefaultPartitionsAhead is how many days of partitions past today a
	// round keeps created (Config.PartitionsAhead).
	DefaultPartitionsAhead = 7
	// MaxPartitionsAhead bounds Config.PartitionsAhead.
	MaxPartitionsAhead = 366
	// PartitionLockTimeout bounds how long attaching or detaching one
	// partition waits for its lock (the lock_timeout of that statement);
	// a partition that could not be handled is retried next round.
	PartitionLockTimeout = 2 * time.Second
	// MaxPartitionsPerRound bounds the partitions one round detaches and
	// drops; the rest are dropped by the next rounds.
	MaxPartitionsPerRound = 32
	// defaultRowsCap bounds the count of the DEFAULT partition's rows.
	defaultRowsCap = 100000
)

// The partition mode of a table (Store.Partitions set). When the table is
// partitioned by range on a timestamptz column by UTC day (as the outbox's
// partitioned layout, outbox.PartitionedMigrations), a round does not
// delete rows; it
//
//   - creates the daily partitions from today to Config.PartitionsAhead
//     days ahead that are missing, each as a plain table then ATTACHed
//     (a SHARE UPDATE EXCLUSIVE lock on the parent: writers go on);
//   - detaches and drops, at most MaxPartitionsPerRound of them, the
//     partitions whose upper bound is older than Config.Retention and that
//     hold no row matching Keep (pending or failed events); one that does
//     is kept and reported (Stats.PartitionsKept);
//   - counts the rows of the DEFAULT partition (Stats.DefaultRows): rows
//     land there only when no daily partition covers their day.
//
// The expired partitions of a round are detached with plain DETACH, in
// one transaction with a last look for Keep rows and the DROPs, under
// PartitionLockTimeout: DETACH CONCURRENTLY is not allowed on a table with
// a DEFAULT partition, and the transaction is what makes dropping a row
// that turned pending again (say, by `outbox retry-failed`) impossible.
// The ACCESS EXCLUSIVE lock it takes on the parent lasts milliseconds,
// once a round that has partitions to drop (once a day).

// partitioned reports whether the table is a partitioned table in the
// partition mode of t.
func (c *Cleaner) partitioned(ctx context.Context, q storage.Querier) (bool, error) {
	if c.t.Store.Partitions == nil {
		return false, nil
	}
	part, err := storage.IsPartitioned(ctx, q, c.t.Store.Name)
	if err != nil {
		return false, c.wrap("looking up the layout of the table of", err)
	}
	return part, nil
}

func (c *Cleaner) partitions(ctx context.Context, q storage.Querier) ([]storage.Partition, error) {
	ps, err := storage.ListPartitions(ctx, q, c.t.Store.Name, c.cfg.Retention)
	if err != nil {
		return nil, c.wrap("listing the partitions holding", err)
	}
	return ps, nil
}

// countPartitions is Count in partition mode: the rows (estimated from
// pg_class.reltuples) of the partitions a round would drop, if none of
// them holds a row to keep.
func (c *Cleaner) countPartitions(ctx context.Context) (int64, error) {
	ps, err := c.partitions(ctx, c.db)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, p := range ps {
		if !p.Expired {
			continue
		}
		kept, err := c.keptRows(ctx, c.db, p.Name)
		if err != nil {
			return 0, err
		}
		if kept == 0 {
			n += p.Tuples
		}
	}
	return n, nil
}

// keptRows counts the rows of partition name that Keep protects.
func (c *Cleaner) keptRows(ctx context.Context, q storage.Querier, name string) (int64, error) {
	n, err := storage.KeptRows(ctx, q, c.t.Store, name)
	if err != nil {
		return 0, c.wrap("looking for rows to keep in partition "+name+" of", err)
	}
	return n, nil
}

// partitionRound is RunOnce in partition mode, on conn holding the lock.
// A failing step does not stop the others; their errors are joined.
func (c *Cleaner) partitionRound(ctx context.Context, conn *storage.Session) (Stats, error) {
	var stats Stats
	ps, err := c.partitions(ctx, conn)
	if err != nil {
		return stats, err
	}
	errs := []error{c.createAhead(ctx, conn, ps, &stats), c.dropExpired(ctx, conn, ps, &stats)}
	for _, p := range ps {
		if !p.IsDefault {
			continue
		}
		var err error
		if stats.DefaultRows, err = storage.CountRows(ctx, conn, p.Name, defaultRowsCap); err != nil {
			errs = append(errs, c.wrap("counting the rows of the default partition of", err))
		}
	}
	return stats, errors.Join(errs...)
}

// createAhead creates the missing partitions of today and the next
// PartitionsAhead days, by UTC day (the server's clock).
func (c *Cleaner) createAhead(ctx context.Context, conn *storage.Session, ps []storage.Partition, stats *Stats) error {
	today, err := storage.UTCToday(ctx, conn)
	if err != nil {
		return c.wrap("reading the date for the partitions of", err)
	}
	have := map[string]bool{}
	for _, p := range ps {
		have[p.Name] = true
	}
	var errs []error
	for d := 0; d <= c.cfg.PartitionsAhead; d++ {
		day := today.AddDate(0, 0, d)
		name := PartitionName(c.t.Store.Name, day)
		if have[name] {
			continue
		}
		if err := c.createPartition(ctx, conn, name, day); err != nil {
			errs = append(errs, err)
			continue
		}
		stats.PartitionsCreated++
	}
	return errors.Join(errs...)
}

// dropExpired drops, in one transaction, the expired partitions that hold
// nothing to keep as far as a look without a lock tells (dropPartitions
// looks again under the lock).
func (c *Cleaner) dropExpired(ctx context.Context, conn *storage.Session, ps []storage.Partition, stats *Stats) error {
	var errs []error
	var drop []storage.Partition
	for _, p := range ps {
		if p.IsDefault || !p.Expired {
			continue
		}
		if len(drop) >= MaxPartitionsPerRound {
			break
		}
		kept, err := c.keptRows(ctx, conn, p.Name)
		switch {
		case err != nil:
			errs = append(errs, err)
		case kept > 0:
			stats.PartitionsKept = append(stats.PartitionsKept, c.keptNote(p.Name, kept))
		default:
			drop = append(drop, p)
		}
	}
	if len(drop) == 0 {
		return errors.Join(errs...)
	}
	if c.beforeDrop != nil {
		c.beforeDrop()
	}
	dropped, kept, err := c.dropPartitions(ctx, conn, drop)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	stats.PartitionsKept = append(stats.PartitionsKept, kept...)
	for _, p := range dropped {
		stats.PartitionsDropped++
		stats.DroppedRows += p.Tuples
	}
	return errors.Join(errs...)
}

// PartitionName is the name of table's partition of the UTC day of day:
// table_pYYYYMMDD.
func PartitionName(table string, day time.Time) string {
	return table + "_p" + day.UTC().Format("20060102")
}

// inTx runs f in a transaction of conn whose lock waits are bounded by
// PartitionLockTimeout (set by f's first batch when lockSet, else here).
func (c *Cleaner) inTx(ctx context.Context, conn *storage.Session, lockSet bool, f func(tx storage.Tx) error) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if !lockSet {
		if err := storage.SetLockTimeout(ctx, tx, PartitionLockTimeout); err != nil {
			return err
		}
	}
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// createPartition creates the partition of day as a plain table and
// attaches it (storage.CreatePartition).
func (c *Cleaner) createPartition(ctx context.Context, conn *storage.Session, name string, day time.Time) error {
	err := c.inTx(ctx, conn, true, func(tx storage.Tx) error {
		return storage.CreatePartition(ctx, tx, c.t.Store, name, day, day.AddDate(0, 0, 1), PartitionLockTimeout)
	})
	if err != nil {
		hint := ""
		if storage.Code(err) == "23514" {
			hint = " (the DEFAULT partition holds rows of that day: move them out, see docs/partitioning.md)"
		}
		return fmt.Errorf("%s: cleaner: creating partition %s of %s%s: %w", c.t.Component, name, c.t.Store.Name, hint, err)
	}
	return nil
}

// dropPartitions detaches and drops the partitions ps in one
// transaction, so that writers wait for the parent's ACCESS EXCLUSIVE lock
// once a round, not once a partition. Each partition is detached in a
// savepoint and looked at once more for rows to keep: under the lock none
// can appear, and one that has some (made pending again since the look
// without the lock) is put back by rolling back to the savepoint and
// reported kept. The DROP returns the space at commit.
func (c *Cleaner) dropPartitions(ctx context.Context, conn *storage.Session, ps []storage.Partition) (dropped []storage.Partition, kept []string, err error) {
	err = c.inTx(ctx, conn, false, func(tx storage.Tx) error {
		dropped, kept = nil, nil
		for _, p := range ps {
			if err := storage.DetachPartition(ctx, tx, c.t.Store, p.Name); err != nil {
				return err
			}
			n, err := c.keptRows(ctx, tx, p.Name)
			if err != nil {
				return err
			}
			if n > 0 {
				if err := storage.RestorePartition(ctx, tx); err != nil {
					return err
				}
				kept = append(kept, c.keptNote(p.Name, n))
				continue
			}
			if err := storage.DropPartition(ctx, tx, p.Name); err != nil {
				return err
			}
			dropped = append(dropped, p)
		}
		return nil
	})
	if err != nil {
		names := make([]string, len(ps))
		for i, p := range ps {
			names[i] = p.Name
		}
		return nil, nil, fmt.Errorf("%s: cleaner: dropping partitions %s of %s (nothing dropped; retried next round): %w", c.t.Component, strings.Join(names, ", "), c.t.Store.Name, err)
	}
	return dropped, kept, nil
}

func (c *Cleaner) keptNote(name string, n int64) string {
	return fmt.Sprintf("%s (%d rows where %s)", name, n, strings.Join(c.t.Store.Partitions.Keep, " or "))
}

// logPartitions logs what a partition-mode round did; rows in the DEFAULT
// partition and partitions kept for their pending rows are warnings an
// operator must see.
func (c *Cleaner) logPartitions(stats Stats) {
	f := watermill.LogFields{"table": c.t.Store.Name}
	if stats.PartitionsCreated > 0 || stats.PartitionsDropped > 0 {
		c.cfg.Logger.Info("Maintained the partitions of "+c.t.Rows, watermill.LogFields{
			"table": c.t.Store.Name, "created": stats.PartitionsCreated, "dropped": stats.PartitionsDropped, "dropped_rows_estimate": stats.DroppedRows,
		})
	}
	if len(stats.PartitionsKept) > 0 {
		c.cfg.Logger.Error("Partitions past the retention kept: they hold rows that must not be dropped", nil,
			watermill.LogFields{"table": c.t.Store.Name, "partitions": strings.Join(stats.PartitionsKept, ", ")})
	}
	if stats.DefaultRows > 0 {
		f["rows"] = stats.DefaultRows
		c.cfg.Logger.Error("Rows in the DEFAULT partition: no daily partition covered their day (was the cleaner stopped, or created_at set by hand?)", nil, f)
	}
}

// partitionNews reports whether a partition-mode round did or found
// something worth logging.
func (s Stats) partitionNews() bool {
	return s.PartitionsCreated > 0 || s.PartitionsDropped > 0 || len(s.PartitionsKept) > 0 || s.DefaultRows > 0
}
