package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// DefaultRetention is how long processed marks are kept by default: a
// redelivery later than this is processed again. Seven days covers broker
// retention and replays after most incidents.
const DefaultRetention = 7 * 24 * time.Hour

// cleanerLockClass is the first key of the advisory lock the cleaner holds
// while deleting; the second is a hash of the schema, so cleaners of
// different schemas do not exclude each other.
const cleanerLockClass int32 = 0x6d775045 // "mwPE"

// CleanerConfig configures a Cleaner.
type CleanerConfig struct {
	// Retention is how long marks are kept. Default DefaultRetention
	// (7 days); at least one minute.
	Retention time.Duration
	// BatchSize is the most rows one DELETE removes, bounding how long each
	// statement holds its row locks and how much WAL it writes at once.
	// Default 1000; 1 to 100000.
	BatchSize int
	// Interval is the pause between cleaning runs. Default 1 minute; at
	// least 10 ms.
	Interval time.Duration
	// Logger logs cleaning runs and errors. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *CleanerConfig) setDefaults() {
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field.
func (c CleanerConfig) Validate() error {
	if c.Retention < time.Minute {
		return fmt.Errorf("idempotency: CleanerConfig.Retention %s is too short: marks must outlive redeliveries; use at least 1m (default 7 days)", c.Retention)
	}
	if c.BatchSize < 1 || c.BatchSize > 100000 {
		return fmt.Errorf("idempotency: CleanerConfig.BatchSize %d out of range: want 1 to 100000 (default 1000)", c.BatchSize)
	}
	if c.Interval < 10*time.Millisecond {
		return fmt.Errorf("idempotency: CleanerConfig.Interval %s too short: want at least 10ms (default 1m)", c.Interval)
	}
	return nil
}

// CleanStats reports one cleaning run.
type CleanStats struct {
	// Deleted is the number of marks removed.
	Deleted int64
	// Batches is the number of DELETE statements that removed rows.
	Batches int
	// Skipped is true when another cleaner held the lock, so this run did
	// nothing.
	Skipped bool
}

// Cleaner removes processed marks older than the retention period from the
// Postgres table, in bounded batches, on one instance at a time. Run one in
// every consumer process: the advisory lock lets one of them work while the
// others skip.
type Cleaner struct {
	db  *sql.DB
	cfg CleanerConfig

	mu        sync.Mutex
	started   bool
	closing   chan struct{}
	closeOnce sync.Once
	running   chan struct{}
	done      chan struct{}
}

// NewCleaner returns a cleaner of the millwright_processed_events table in
// db's search_path schema.
func NewCleaner(db *sql.DB, cfg CleanerConfig) (*Cleaner, error) {
	if db == nil {
		return nil, errors.New("idempotency: NewCleaner: db is nil; pass an open *sql.DB (lib/pq)")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Cleaner{
		db: db, cfg: cfg,
		closing: make(chan struct{}), running: make(chan struct{}), done: make(chan struct{}),
	}, nil
}

// Run cleans every Interval, starting at once, until ctx is done or Close is
// called; it then returns nil. A failed run is logged and retried at the next
// interval. Run may be called once; after Close it returns nil at once.
func (c *Cleaner) Run(ctx context.Context) error {
	c.mu.Lock()
	select {
	case <-c.closing:
		c.mu.Unlock()
		return nil
	default:
	}
	if c.started {
		c.mu.Unlock()
		return errors.New("idempotency: Cleaner.Run called twice; create one Cleaner per Run")
	}
	c.started = true
	c.mu.Unlock()
	defer close(c.done)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-c.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	close(c.running)

	ticker := time.NewTicker(c.cfg.Interval)
	defer ticker.Stop()
	for {
		if ctx.Err() != nil {
			return nil
		}
		stats, err := c.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			c.cfg.Logger.Error("Cleaning processed events failed; retrying at the next interval", err, nil)
		case err == nil && stats.Deleted > 0:
			c.cfg.Logger.Info("Cleaned processed events", watermill.LogFields{"deleted": stats.Deleted, "batches": stats.Batches})
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// Running is closed once Run has started.
func (c *Cleaner) Running() <-chan struct{} { return c.running }

// Close stops Run, cancelling the batch in flight (a cancelled batch rolls
// back whole; the next run redoes it), and waits for Run to return. It is
// idempotent and safe to call when Run was never called.
func (c *Cleaner) Close() error {
	c.mu.Lock()
	c.closeOnce.Do(func() { close(c.closing) }) // under mu: a Run after Close returns at once
	started := c.started
	c.mu.Unlock()
	if started {
		<-c.done
	}
	return nil
}

// CountExpired returns how many marks RunOnce would delete now: those
// older than the retention period. It takes no lock and changes nothing
// (the operator CLI's dry run).
func (c *Cleaner) CountExpired(ctx context.Context) (int64, error) {
	var n int64
	err := c.db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_processed_events
		WHERE processed_at < now() - make_interval(secs => $1)`, c.cfg.Retention.Seconds()).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("idempotency: cleaner: counting marks older than %s%s: %w", c.cfg.Retention, migrationHint(err), err)
	}
	return n, nil
}

// RunOnce deletes every mark older than the retention period, BatchSize rows
// per statement, unless another cleaner of the same schema holds the lock.
// Each batch is its own transaction and skips rows locked by others, so
// consumers never wait on the cleaner.
func (c *Cleaner) RunOnce(ctx context.Context) (CleanStats, error) {
	var stats CleanStats
	conn, err := c.db.Conn(ctx)
	if err != nil {
		return stats, fmt.Errorf("idempotency: cleaner: connecting: %w", err)
	}
	defer conn.Close()

	var locked bool
	if err := conn.QueryRowContext(ctx,
		`SELECT pg_try_advisory_lock($1, hashtext(current_schema()))`, cleanerLockClass).Scan(&locked); err != nil {
		return stats, fmt.Errorf("idempotency: cleaner: taking advisory lock: %w", err)
	}
	if !locked {
		stats.Skipped = true
		return stats, nil
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), //nolint:errcheck // the lock goes with the session anyway
		`SELECT pg_advisory_unlock($1, hashtext(current_schema()))`, cleanerLockClass)

	for {
		res, err := conn.ExecContext(ctx, `
			DELETE FROM millwright_processed_events WHERE ctid IN (
				SELECT ctid FROM millwright_processed_events
				WHERE processed_at < now() - make_interval(secs => $1)
				LIMIT $2
				FOR UPDATE SKIP LOCKED)`,
			c.cfg.Retention.Seconds(), c.cfg.BatchSize)
		if err != nil {
			return stats, fmt.Errorf("idempotency: cleaner: deleting marks older than %s%s: %w", c.cfg.Retention, migrationHint(err), err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return stats, fmt.Errorf("idempotency: cleaner: %w", err)
		}
		if n > 0 {
			stats.Deleted += n
			stats.Batches++
		}
		if n < int64(c.cfg.BatchSize) {
			return stats, nil
		}
	}
}
