package retention

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/schemacheck"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Defaults shared by every table (Retention's default is the table's).
const (
	DefaultBatchSize    = 1000
	MaxBatchSize        = 100000
	DefaultInterval     = time.Minute
	DefaultCloseTimeout = 30 * time.Second
)

// Config configures a Cleaner, of any table. The zero value is valid:
// every field has a default.
type Config struct {
	// Retention is how long rows are kept after they qualify for deletion
	// (published, processed, dead-lettered, finished). Default and minimum
	// depend on the table: see its constructor (NewOutboxCleaner, ...) and
	// the Default...Retention constants.
	Retention time.Duration
	// BatchSize is the most rows one DELETE removes; each batch is its own
	// short transaction, so cleaning never holds long locks nor writes one
	// huge WAL record. Default 1000; valid 1..100000.
	BatchSize int
	// Interval between cleaning rounds of Run. Default 1 minute; minimum 1ms.
	Interval time.Duration
	// CloseTimeout bounds how long Close waits for the batch in flight
	// before cancelling it (a cancelled batch rolls back whole; the next
	// round redoes it). Default 30s; 0 means the default, negative is
	// invalid.
	CloseTimeout time.Duration
	// Logger logs rounds that deleted rows (info) and failed rounds
	// (error). Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// PartitionsAhead, for a partitioned table only (see Partitions), is
	// how many days of partitions past today each round keeps created.
	// Default DefaultPartitionsAhead (7); valid 1..MaxPartitionsAhead.
	PartitionsAhead int
	// Registerer receives millwright_loop_panics_total (outbox.
	// MetricLoopPanics), with the component label "<component>.Cleaner":
	// the rounds of Run that panicked (each is recovered, logged and
	// retried at the next interval). Default nil: counted, not
	// registered.
	Registerer prometheus.Registerer
}

// Stats reports one round of a Cleaner.
type Stats struct {
	// Deleted is the number of rows removed (a saga's steps, removed with
	// it by the foreign key's cascade, are not counted).
	Deleted int64
	// Batches is the number of DELETE statements that removed rows.
	Batches int
	// Skipped is true when another cleaner of the same table and schema
	// held the lock, so this round did nothing. It is not a failure.
	Skipped bool

	// Partition mode only (Partitions): partitions created ahead and
	// dropped, the rows of the dropped ones (estimated from
	// pg_class.reltuples), the partitions past the retention kept because
	// they hold rows to keep (name and count), and the rows in the DEFAULT
	// partition (at most 100000 counted).
	PartitionsCreated, PartitionsDropped int
	DroppedRows                          int64
	PartitionsKept                       []string
	DefaultRows                          int64
}

// table says what one cleaner deletes.
type table struct {
	// Component names the owner in errors, logs and the lock ("outbox").
	Component string
	// Name is the table's in its constructor's name (New<Name>Cleaner).
	Name string
	// Rows names the rows in messages ("published events").
	Rows string
	// Store is the table and the SQL of its DELETE, its lock and its
	// partition mode: one of the storage layer's RetentionTables
	// (storage.OutboxRetention, ...). When Store.Partitions is set and
	// the table is a partitioned table, rounds drop whole partitions
	// instead of deleting rows (see the partition mode in doc.go); when
	// it is a plain table they delete.
	Store storage.RetentionTable
	// DefaultRetention and MinRetention apply to Config.Retention.
	DefaultRetention, MinRetention time.Duration
	// Hint, optional, turns a database error into advice appended to the
	// error message (e.g. "run `millwright migrate`").
	Hint func(error) string
}

// setDefaults fills the zero fields of c, Retention with t's default.
func (c *Config) setDefaults(t table) {
	if c.Retention == 0 {
		c.Retention = t.DefaultRetention
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Interval == 0 {
		c.Interval = DefaultInterval
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.PartitionsAhead == 0 {
		c.PartitionsAhead = DefaultPartitionsAhead
	}
}

// validate reports every invalid field of c (after setDefaults), naming
// t's component.
func (c Config) validate(t table) error {
	var errs []error
	p := t.Component + " cleaner: retention.Config."
	if c.Retention < t.MinRetention {
		errs = append(errs, fmt.Errorf("%sRetention %s is too short: want at least %s (default %s)", p, c.Retention, t.MinRetention, t.DefaultRetention))
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		errs = append(errs, fmt.Errorf("%sBatchSize %d out of range: want 1..%d (default %d)", p, c.BatchSize, MaxBatchSize, DefaultBatchSize))
	}
	if c.Interval < time.Millisecond {
		errs = append(errs, fmt.Errorf("%sInterval %s too short: want at least 1ms (default %s)", p, c.Interval, DefaultInterval))
	}
	if c.CloseTimeout < 0 {
		errs = append(errs, fmt.Errorf("%sCloseTimeout %s is negative: want 0 (default %s) or more", p, c.CloseTimeout, DefaultCloseTimeout))
	}
	if c.PartitionsAhead < 1 || c.PartitionsAhead > MaxPartitionsAhead {
		errs = append(errs, fmt.Errorf("%sPartitionsAhead %d out of range: want 1..%d (default %d)", p, c.PartitionsAhead, MaxPartitionsAhead, DefaultPartitionsAhead))
	}
	return errors.Join(errs...)
}

// Cleaner deletes the old rows of one table, in batches, on one instance at
// a time. It is safe for concurrent use.
type Cleaner struct {
	db  storage.Pool
	t   table
	cfg Config
	r   *runner.Runner
	// guard keeps a round's panic from ending Run.
	guard *runner.Guard

	// beforeRound, in tests, runs at the start of each round of Run.
	beforeRound func()

	// beforeDrop, in tests, runs between the look for rows to keep
	// without a lock and the transaction that drops partitions.
	beforeDrop func()
}

// newCleaner returns a cleaner of t in db. It sets cfg's defaults and
// validates it.
func newCleaner(db postgres.DB, t table, cfg Config) (*Cleaner, error) {
	p, err := storage.FromDB(db)
	if err != nil {
		return nil, fmt.Errorf("retention: New%sCleaner: %w: pass the database holding %s (postgres.From(pool))", t.Name, err, t.Store.Name)
	}
	return newOn(p, t, cfg)
}

// newOn is newCleaner on a storage pool.
func newOn(db storage.Pool, t table, cfg Config) (*Cleaner, error) {
	cfg.setDefaults(t)
	if err := cfg.validate(t); err != nil {
		return nil, err
	}
	g, err := runner.NewGuard(t.Component+".Cleaner", cfg.Registerer, cfg.Logger)
	if err != nil {
		return nil, err
	}
	return &Cleaner{db: db, t: t, cfg: cfg, r: runner.New(t.Component+".Cleaner", cfg.CloseTimeout), guard: g}, nil
}

// Config returns the configuration in use, defaults set.
func (c *Cleaner) Config() Config { return c.cfg }

// Running is closed once Run has started.
func (c *Cleaner) Running() <-chan struct{} { return c.r.Running() }

// startCheckTimeout bounds Run's check of its table.
const startCheckTimeout = 30 * time.Second

// Run runs a round at once and then every Interval until ctx is done or
// Close is called; it then returns nil. A failed round is logged and
// retried at the next interval, and so is a round that panicked (logged
// with its stack and counted in millwright_loop_panics_total). Before the first round it checks that the
// table exists in the search_path and returns an error naming it and the
// fix (`millwright migrate`) if it does not; while the database cannot be
// asked it logs and asks again at the next interval. Run may be called
// once; after Close it returns nil at once.
func (c *Cleaner) Run(ctx context.Context) error {
	return c.r.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		for checked := false; !checked; {
			// Bounded: a server that never answers is retried, not waited on.
			cctx, cancel := context.WithTimeout(ctx, startCheckTimeout)
			err := schemacheck.Check(cctx, c.db, c.t.Component+": cleaner", c.t.Store.Name)
			cancel()
			var missing *schemacheck.MissingError
			switch {
			case err == nil:
				checked = true
				continue
			case errors.As(err, &missing):
				return err
			case ctx.Err() != nil:
				return nil
			}
			c.cfg.Logger.Error("Checking the table to clean failed; retrying at the next interval", err, watermill.LogFields{"table": c.t.Store.Name})
			if !runner.Wait(ctx, draining, c.cfg.Interval) {
				return nil
			}
		}
		for {
			// A round that panics is logged and counted by the guard and
			// retried at the next interval, like a failed one: it has no
			// record of its own to set aside (its rows are deleted by
			// SQL), and Run must not end with it.
			_ = c.guard.Do("cleaning "+c.t.Rows+"; retrying at the next interval", watermill.LogFields{"table": c.t.Store.Name}, func() error {
				c.round(ctx)
				return nil
			})
			if !runner.Wait(ctx, draining, c.cfg.Interval) {
				return nil
			}
		}
	})
}

// round is one round of Run, logged.
func (c *Cleaner) round(ctx context.Context) {
	if c.beforeRound != nil {
		c.beforeRound()
	}
	stats, err := c.RunOnce(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		c.cfg.Logger.Error("Cleaning "+c.t.Rows+" failed; retrying at the next interval", err,
			watermill.LogFields{"table": c.t.Store.Name})
	case err == nil && stats.partitionNews():
		c.logPartitions(stats)
	case err == nil && stats.Deleted > 0:
		c.cfg.Logger.Info("Cleaned "+c.t.Rows, watermill.LogFields{
			"table": c.t.Store.Name, "deleted": stats.Deleted, "batches": stats.Batches,
		})
	}
}

// Close stops Run after the batch in flight, cancelling it if it takes
// longer than CloseTimeout, and waits for Run to return. It is idempotent
// and safe to call when Run was never called.
func (c *Cleaner) Close() error { return c.r.Close() }

// Draining is closed once Close has been called.
func (c *Cleaner) Draining() <-chan struct{} { return c.r.Draining() }

func (c *Cleaner) wrap(what string, err error) error {
	hint := ""
	if c.t.Hint != nil {
		hint = c.t.Hint(err)
	}
	return fmt.Errorf("%s: cleaner: %s %s older than %s%s: %w", c.t.Component, what, c.t.Rows, c.cfg.Retention, hint, err)
}

// Count returns how many rows RunOnce would delete now. It takes no lock
// and changes nothing (the CLI's dry run).
func (c *Cleaner) Count(ctx context.Context) (int64, error) {
	if part, err := c.partitioned(ctx, c.db); err != nil {
		return 0, err
	} else if part {
		return c.countPartitions(ctx)
	}
	n, err := storage.CountRetained(ctx, c.db, c.t.Store, c.cfg.Retention)
	if err != nil {
		return 0, c.wrap("counting", err)
	}
	return n, nil
}

// RunOnce deletes every qualifying row, BatchSize rows per statement,
// unless another cleaner of the same table and schema holds the lock
// (Stats.Skipped). Each batch is its own transaction and skips rows locked
// by others, so writers never wait on the cleaner. After Close it stops
// between batches.
func (c *Cleaner) RunOnce(ctx context.Context) (Stats, error) {
	return c.RunOnceWithProgress(ctx, nil)
}

// RunOnceWithProgress is RunOnce calling progress, if not nil, after each
// batch that deleted rows with the rows deleted so far (once, at the end
// of the round, in partition mode, with the dropped partitions' rows), on
// the caller's goroutine. The CLI's progress report uses it.
func (c *Cleaner) RunOnceWithProgress(ctx context.Context, progress func(deleted int64)) (Stats, error) {
	if progress == nil {
		progress = func(int64) {}
	}
	var stats Stats
	// One session holds the advisory lock and runs the round.
	sess, err := storage.AcquireSession(ctx, c.db)
	if err != nil {
		return stats, fmt.Errorf("%s: cleaner: connecting: %w", c.t.Component, err)
	}
	defer sess.Release()

	locked, err := storage.TryRetentionLock(ctx, sess, c.t.Store)
	if err != nil {
		return stats, fmt.Errorf("%s: cleaner: taking the advisory lock of %s: %w", c.t.Component, c.t.Store.Name, err)
	}
	if !locked {
		stats.Skipped = true
		return stats, nil
	}
	// The lock goes with the session anyway; unlock so that the pooled
	// connection does not keep it.
	defer storage.RetentionUnlock(context.WithoutCancel(ctx), sess, c.t.Store) //nolint:errcheck // see above

	if part, err := c.partitioned(ctx, sess); err != nil {
		return stats, err
	} else if part {
		stats, err := c.partitionRound(ctx, sess)
		progress(stats.DroppedRows)
		return stats, err
	}
	return c.deleteRound(ctx, sess, progress)
}

// deleteRound deletes batches on sess until one is short or Close is
// called.
func (c *Cleaner) deleteRound(ctx context.Context, sess storage.Querier, progress func(int64)) (Stats, error) {
	var stats Stats
	for {
		select {
		case <-c.r.Draining():
			return stats, nil
		default:
		}
		n, err := storage.DeleteRetained(ctx, sess, c.t.Store, c.cfg.Retention, c.cfg.BatchSize)
		if err != nil {
			return stats, c.wrap("deleting", err)
		}
		if n > 0 {
			stats.Deleted += n
			stats.Batches++
			progress(stats.Deleted)
		}
		if n < int64(c.cfg.BatchSize) {
			return stats, nil
		}
	}
}

// missingTable returns a table.Hint that tells to migrate when the error
// is Postgres's undefined_table; migrations names them, e.g.
// "idempotency.Migrations()".
func missingTable(migrations string) func(error) string {
	return func(err error) string {
		if storage.Code(err) == "42P01" {
			return " (table missing: run `millwright migrate` or migrate.Up with " + migrations + ")"
		}
		return ""
	}
}
