package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// MetricSlotRetainedWAL is a gauge, with a "slot" label: the bytes of WAL
// Postgres keeps for each logical replication slot of the database
// (pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)). It grows while
// the slot's consumer (Debezium's connector) is down or behind, and for
// ever for a slot nobody reads: the disk fills and Postgres stops.
const MetricSlotRetainedWAL = "millwright_outbox_replication_slot_retained_wal_bytes"

// CaptureConfig configures a CaptureTracker.
type CaptureConfig struct {
	// Slot is the replication slot Debezium's connector streams the
	// outbox from (its slot.name). Required.
	Slot string
	// Interval between rounds. Default 5 seconds; at least 10ms. Rows
	// Debezium delivered stay pending for up to about two intervals
	// (plus the connector's offset flush), and on the way back to the
	// relay the relay publishes again what Debezium delivered since the
	// newest mark it had confirmed: a shorter interval means fewer
	// duplicates then.
	Interval time.Duration
	// Registerer, optional, gets MetricSlotRetainedWAL, for every slot of
	// the database, refreshed each round.
	Registerer prometheus.Registerer
	// Logger. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// CloseTimeout bounds Close's wait for the round in flight. Default 10s.
	CloseTimeout time.Duration
}

func (c *CaptureConfig) setDefaults() {
	if c.Interval == 0 {
		c.Interval = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 10 * time.Second
	}
}

// Validate reports what is wrong with c, after defaults.
func (c CaptureConfig) Validate() error {
	var errs []error
	if c.Slot == "" {
		errs = append(errs, errors.New("outbox: CaptureConfig.Slot is empty: set the connector's slot.name"))
	}
	if c.Interval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: CaptureConfig.Interval %s: want at least 10ms", c.Interval))
	}
	return errors.Join(errs...)
}

// CaptureTracker keeps the outbox's published state while Debezium relays
// it (Debezium writes nothing back): each round records a capture mark
// (the WAL position and the snapshot) and marks published the pending rows
// of the newest mark the slot has confirmed, so the Cleaner's retention,
// the backlog gauges and `millwright outbox status` work as with the
// relay, and the relay, started again, publishes only what Debezium may
// not have delivered. It also exports MetricSlotRetainedWAL. Run one per
// outbox while its connector runs (more are harmless: rounds are
// idempotent). Its methods are every long-running millwright component's:
// Run, Close, Running, and RunOnce for one round.
type CaptureTracker struct {
	db  storage.Pool
	cfg CaptureConfig
	run *runner.Runner
	wal *prometheus.GaugeVec
}

// CaptureRound reports one round.
type CaptureRound struct {
	// Marked is the rows marked published; Mark the capture mark used (0:
	// the slot has confirmed none yet).
	Marked, Mark int64
	// Slots is every replication slot of the database and its WAL.
	Slots []storage.SlotLag
}

// NewCaptureTracker returns a tracker of the outbox in db's search_path.
func NewCaptureTracker[P postgres.Pool](db P, cfg CaptureConfig) (*CaptureTracker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewCaptureTracker: %w", err)
	}
	t := &CaptureTracker{db: pool, cfg: cfg, run: runner.New("outbox.CaptureTracker", cfg.CloseTimeout),
		wal: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricSlotRetainedWAL,
			Help: "Bytes of WAL Postgres retains for each logical replication slot (pg_replication_slots.restart_lsn to the current position)."}, []string{"slot"})}
	if cfg.Registerer != nil {
		t.wal = promreg.Into(cfg.Registerer, t.wal, &err)
		if err != nil {
			return nil, fmt.Errorf("outbox: registering %s: %w", MetricSlotRetainedWAL, err)
		}
	}
	return t, nil
}

// RunOnce runs one round.
func (t *CaptureTracker) RunOnce(ctx context.Context) (CaptureRound, error) {
	var r CaptureRound
	if _, err := storage.TakeCaptureMark(ctx, t.db); err != nil {
		return r, fmt.Errorf("outbox: recording a capture mark (did `millwright migrate` run?): %w", err)
	}
	var err error
	if r.Marked, r.Mark, err = storage.MarkCaptured(ctx, t.db, t.cfg.Slot); err != nil {
		return r, fmt.Errorf("outbox: marking rows slot %q delivered: %w", t.cfg.Slot, err)
	}
	if r.Slots, err = storage.ReadSlotLag(ctx, t.db); err != nil {
		return r, fmt.Errorf("outbox: reading pg_replication_slots: %w", err)
	}
	t.wal.Reset()
	for _, s := range r.Slots {
		t.wal.WithLabelValues(s.Slot).Set(float64(s.Retained))
	}
	return r, nil
}

// Run runs rounds every Interval until ctx ends or Close. A failed round
// is logged and retried at the next tick.
func (t *CaptureTracker) Run(ctx context.Context) error {
	return t.run.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		tick := time.NewTicker(t.cfg.Interval)
		defer tick.Stop()
		for {
			if _, err := t.RunOnce(ctx); err != nil && ctx.Err() == nil {
				t.cfg.Logger.Error("outbox: capture round failed", err, watermill.LogFields{"slot": t.cfg.Slot})
			}
			select {
			case <-ctx.Done():
				return nil
			case <-draining:
				return nil
			case <-tick.C:
			}
		}
	})
}

// Close stops Run after its round in flight (idempotent).
func (t *CaptureTracker) Close() error { return t.run.Close() }

// Running is closed once Run runs.
func (t *CaptureTracker) Running() <-chan struct{} { return t.run.Running() }

// EnableCapture prepares the outbox in db's search_path for Debezium: the
// trigger that fills the wire_* columns the connector reads (every row
// inserted after it returns has them; it waits for the writing
// transactions in flight) and an insert-only publication named
// publication (the connector's publication.name).
func EnableCapture[P postgres.Pool](ctx context.Context, db P, publication string) error {
	pool, err := storage.PoolFrom(db)
	if err == nil {
		err = storage.EnableCapture(ctx, pool, publication)
	}
	if err != nil {
		return fmt.Errorf("outbox: EnableCapture: %w", err)
	}
	return nil
}

// DisableCapture drops the trigger and the publication: rows written
// after it carry no wire_* columns, and writers pay nothing for capture.
func DisableCapture[P postgres.Pool](ctx context.Context, db P, publication string) error {
	pool, err := storage.PoolFrom(db)
	if err == nil {
		err = storage.DisableCapture(ctx, pool, publication)
	}
	if err != nil {
		return fmt.Errorf("outbox: DisableCapture: %w", err)
	}
	return nil
}
