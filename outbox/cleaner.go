package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// CleanerConfig configures a Cleaner. The zero value is valid.
type CleanerConfig struct {
	// Retention is how long published rows are kept (for audits and
	// replays). Default 7 days; minimum 1ms.
	Retention time.Duration
	// BatchSize is the most rows one DELETE removes; each batch is its own
	// short transaction, so deletion never holds long locks nor builds one
	// huge WAL record. Default 1000; valid 1..100000.
	BatchSize int
	// Interval between cleaning rounds. Default 1 minute; minimum 1ms.
	Interval time.Duration
	// Logger. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *CleanerConfig) setDefaults() {
	if c.Retention == 0 {
		c.Retention = 7 * 24 * time.Hour
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

// Validate reports invalid fields, naming them.
func (c CleanerConfig) Validate() error {
	var errs []error
	if c.Retention < time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: CleanerConfig.Retention %s: want at least 1ms", c.Retention))
	}
	if c.BatchSize < 1 || c.BatchSize > 100000 {
		errs = append(errs, fmt.Errorf("outbox: CleanerConfig.BatchSize %d: want 1..100000", c.BatchSize))
	}
	if c.Interval < time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: CleanerConfig.Interval %s: want at least 1ms", c.Interval))
	}
	return errors.Join(errs...)
}

// Cleaner deletes published rows older than the retention period. Run it
// beside every relay: a Postgres advisory lock lets one instance at a time
// clean (per schema); the others skip the round. Pending and failed rows
// are never deleted.
type Cleaner struct {
	db  *sql.DB
	cfg CleanerConfig

	started   atomic.Bool
	running   chan struct{}
	closing   chan struct{}
	closeOnce sync.Once
	done      chan struct{}
}

// NewCleaner returns a cleaner of the outbox in db's search_path.
func NewCleaner(db *sql.DB, cfg CleanerConfig) (*Cleaner, error) {
	if db == nil {
		return nil, errors.New("outbox: NewCleaner: nil *sql.DB")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Cleaner{db: db, cfg: cfg, running: make(chan struct{}), closing: make(chan struct{}), done: make(chan struct{})}, nil
}

// Running is closed once Run has started.
func (c *Cleaner) Running() <-chan struct{} { return c.running }

// Run cleans every Interval until ctx is cancelled or Close is called.
func (c *Cleaner) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("outbox: Cleaner.Run called twice: create one Cleaner per Run")
	}
	defer close(c.done)
	close(c.running)
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := c.CleanOnce(ctx); err != nil && !errors.Is(err, ErrCleanerLocked) && ctx.Err() == nil {
			c.cfg.Logger.Error("outbox cleaner: round failed, retrying next interval", err, nil)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.closing:
			return nil
		case <-t.C:
		}
	}
}

// Close stops Run after the batch in flight. It is idempotent.
func (c *Cleaner) Close() error {
	c.closeOnce.Do(func() { close(c.closing) })
	if c.started.Load() {
		<-c.done
	}
	return nil
}

// ErrCleanerLocked is returned by CleanOnce when another cleaner holds the
// lock of this outbox; the round is skipped, which is not a failure.
var ErrCleanerLocked = errors.New("outbox: another cleaner is cleaning this outbox")

// CleanOnce deletes, in batches of BatchSize, the rows published before now
// minus Retention, and returns how many it deleted. It holds a session
// advisory lock keyed by the table's schema while it works and returns
// ErrCleanerLocked when another cleaner holds it.
func (c *Cleaner) CleanOnce(ctx context.Context) (int64, error) {
	conn, err := c.db.Conn(ctx)
	if err != nil {
		return 0, fmt.Errorf("outbox cleaner: connecting: %w", err)
	}
	defer conn.Close()
	var locked bool
	// The key is derived from the table's schema so that outboxes in
	// different schemas of one database clean independently.
	const key = `hashtext('millwright_outbox_cleaner:' || (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'millwright_outbox'::regclass))`
	if err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock(`+key+`)`).Scan(&locked); err != nil {
		return 0, fmt.Errorf("outbox cleaner: taking advisory lock (did `millwright migrate` run?): %w", err)
	}
	if !locked {
		return 0, ErrCleanerLocked
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock(`+key+`)`) //nolint:errcheck // released with the session anyway

	var total int64
	for {
		select {
		case <-c.closing:
			return total, nil
		default:
		}
		// The sub-select walks the primary key from the oldest row: old
		// published rows sit at its start, so each batch reads little more
		// than it deletes.
		res, err := conn.ExecContext(ctx, `DELETE FROM millwright_outbox WHERE id IN (
			SELECT id FROM millwright_outbox
			WHERE status = 'published' AND published_at < now() - $1 * interval '1 millisecond'
			ORDER BY id LIMIT $2)`, c.cfg.Retention.Milliseconds(), c.cfg.BatchSize)
		if err != nil {
			return total, fmt.Errorf("outbox cleaner: deleting published rows: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, fmt.Errorf("outbox cleaner: %w", err)
		}
		total += n
		if n < int64(c.cfg.BatchSize) {
			return total, nil
		}
	}
}
