package capture

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

// Config configures a Tracker.
type Config struct {
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

func (c *Config) setDefaults() {
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
func (c Config) Validate() error {
	var errs []error
	if c.Slot == "" {
		errs = append(errs, errors.New("outbox: capture.Config.Slot is empty: set the connector's slot.name"))
	}
	if c.Interval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: capture.Config.Interval %s: want at least 10ms", c.Interval))
	}
	return errors.Join(errs...)
}

// Tracker keeps the outbox's published state while Debezium relays
// it (Debezium writes nothing back): each round records a capture mark
// (the WAL position and the snapshot) and marks published the pending rows
// the slot streamed that the newest mark it has confirmed sees: rows
// judged by the transaction that inserted them, inserted after the slot's
// boundary (SwitchToDebezium registers it). So the Cleaner's retention,
// the backlog gauges and `millwright outbox status` work as with the
// relay, and the relay, started again, publishes only what Debezium may
// not have delivered. It also exports MetricSlotRetainedWAL. Run one per
// outbox while its connector runs (more are harmless: rounds are
// idempotent). Its methods are every long-running millwright component's:
// Run, Close, Running, and RunOnce for one round.
type Tracker struct {
	db    storage.Pool
	cfg   Config
	run   *runner.Runner
	wal   *prometheus.GaugeVec
	guard *runner.Guard
	hook  func(*Round) // tests: runs inside each round
}

// Round reports one round.
type Round struct {
	// Marked is the rows marked published; Mark the capture mark used (0:
	// the slot has confirmed none yet).
	Marked, Mark int64
	// Slots is every replication slot of the database and its WAL.
	Slots []storage.SlotLag
}

// NewTracker returns a tracker of the outbox in db's search_path.
func NewTracker(db postgres.DB, cfg Config) (*Tracker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("capture.NewTracker: %w", err)
	}
	t := &Tracker{db: pool, cfg: cfg, run: runner.New("outbox.CaptureTracker", cfg.CloseTimeout),
		wal: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricSlotRetainedWAL,
			Help: "Bytes of WAL Postgres retains for each logical replication slot (pg_replication_slots.restart_lsn to the current position)."}, []string{"slot"})}
	if t.guard, err = runner.NewGuard("outbox.CaptureTracker", cfg.Registerer, cfg.Logger); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		t.wal = promreg.Into(cfg.Registerer, t.wal, &err)
		if err != nil {
			return nil, fmt.Errorf("outbox: registering %s: %w", MetricSlotRetainedWAL, err)
		}
	}
	return t, nil
}

// RunOnce runs one round. A slot no switch registered fails the round
// with an error wrapping ErrSlotNotRegistered (the WAL gauge is still
// refreshed): use SwitchToDebezium.
func (t *Tracker) RunOnce(ctx context.Context) (Round, error) {
	var r Round
	var err error
	if r.Slots, err = storage.ReadSlotLag(ctx, t.db); err != nil {
		return r, fmt.Errorf("outbox: reading pg_replication_slots: %w", err)
	}
	t.wal.Reset()
	for _, s := range r.Slots {
		t.wal.WithLabelValues(s.Slot).Set(float64(s.Retained))
	}
	if t.hook != nil {
		t.hook(&r)
	}
	if _, err := storage.TakeCaptureMark(ctx, t.db); err != nil {
		return r, fmt.Errorf("outbox: recording a capture mark%s: %w", storage.Hint(err), err)
	}
	if r.Marked, r.Mark, err = storage.MarkCaptured(ctx, t.db, t.cfg.Slot); err != nil {
		return r, fmt.Errorf("outbox: marking rows slot %q delivered: %w", t.cfg.Slot, err)
	}
	return r, nil
}

// round is RunOnce that returns a panic as an error (logged with the
// slot and the stack, and counted in MetricLoopPanics with component
// capture.Tracker): one bad round must not end Run.
func (t *Tracker) round(ctx context.Context) (r Round, err error) {
	err = t.guard.Do("in a capture round (the next round runs at the next tick)", watermill.LogFields{"slot": t.cfg.Slot}, func() error {
		var err error
		r, err = t.RunOnce(ctx)
		return err
	})
	return r, err
}

// Run runs rounds every Interval until ctx ends or Close. A failed round
// is logged and retried at the next tick; so is a round that panicked
// (counted in MetricLoopPanics).
func (t *Tracker) Run(ctx context.Context) error {
	return t.run.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		tick := time.NewTicker(t.cfg.Interval)
		defer tick.Stop()
		for {
			if r, err := t.round(ctx); err != nil && ctx.Err() == nil && !runner.IsPanic(err) { // a panic is logged by the guard
				t.cfg.Logger.Error("outbox: capture round failed", err, watermill.LogFields{"slot": t.cfg.Slot, "mark": r.Mark, "marked": r.Marked})
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
func (t *Tracker) Close() error { return t.run.Close() }

// Running is closed once Run runs.
func (t *Tracker) Running() <-chan struct{} { return t.run.Running() }

// Enable is SwitchToDebezium's first step, for tools that create
// the slot themselves; prefer SwitchToDebezium. It prepares the outbox in
// db's search_path for Debezium: the
// trigger that fills the wire_* columns the connector reads (every row
// inserted after it returns has them; it waits for the writing
// transactions in flight) and an insert-only publication named
// publication (the connector's publication.name).
func Enable(ctx context.Context, db postgres.DB, publication string) error {
	pool, err := storage.PoolFrom(db)
	if err == nil {
		err = storage.EnableCapture(ctx, pool, publication)
	}
	if err != nil {
		return fmt.Errorf("capture.Enable: %w", err)
	}
	return nil
}

// Disable drops the trigger and the publication: rows written
// after it carry no wire_* columns, and writers pay nothing for capture.
func Disable(ctx context.Context, db postgres.DB, publication string) error {
	pool, err := storage.PoolFrom(db)
	if err == nil {
		err = storage.DisableCapture(ctx, pool, publication)
	}
	if err != nil {
		return fmt.Errorf("capture.Disable: %w", err)
	}
	return nil
}

// ErrSlotNotRegistered is returned (wrapped) by Tracker rounds on a
// slot SwitchToDebezium did not register.
var ErrSlotNotRegistered = storage.ErrSlotNotRegistered

// SwitchConfig configures SwitchToDebezium and SwitchToRelay.
type SwitchConfig struct {
	// Slot is the replication slot (the connector's slot.name). Required.
	Slot string
	// Publication is the publication (the connector's publication.name).
	// Required.
	Publication string
	// DryRun reports what the switch would do and changes nothing.
	DryRun bool
	// Wait (SwitchToDebezium only) is how long to wait for the relays to
	// publish the pending rows from before the slot. Default 0: report
	// their count at once; run again (it is idempotent) until Ready.
	Wait time.Duration
	// PollInterval between counts while waiting. Default 500ms.
	PollInterval time.Duration
}

func (c *SwitchConfig) setDefaults() {
	if c.PollInterval == 0 {
		c.PollInterval = 500 * time.Millisecond
	}
}

// Validate reports what is wrong with c, after defaults.
func (c SwitchConfig) Validate() error {
	var errs []error
	if c.Slot == "" {
		errs = append(errs, errors.New("outbox: capture.SwitchConfig.Slot is empty: set the connector's slot.name"))
	}
	if c.Publication == "" {
		errs = append(errs, errors.New("outbox: capture.SwitchConfig.Publication is empty: set the connector's publication.name"))
	}
	if c.Wait < 0 || c.PollInterval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: capture.SwitchConfig.Wait %s, PollInterval %s: want Wait >= 0, PollInterval >= 10ms", c.Wait, c.PollInterval))
	}
	return errors.Join(errs...)
}

// State is the state of capture a switch found.
type State struct {
	WALLevel    string
	Trigger     bool   // the capture trigger exists
	Publication bool   // the named publication exists
	SlotExists  bool   // the named replication slot exists
	SlotActive  bool   // a connector streams from the slot
	Confirmed   string // the slot's confirmed_flush_lsn
	Registered  bool   // the slot has a boundary (SwitchToDebezium)
	BoundaryLSN string
	// Registrations is every registered slot of this outbox.
	Registrations []string
}

func readState(ctx context.Context, pool storage.Pool, cfg SwitchConfig) (State, error) {
	st, err := storage.ReadCaptureState(ctx, pool, cfg.Slot, cfg.Publication)
	return State(st), err
}

// SwitchReport says what a switch did (or, in a dry run, would do) and
// what the operator does next.
type SwitchReport struct {
	DryRun bool
	// Steps done (or, DryRun, to do), in order.
	Steps []string
	// Before is the state found.
	Before State
	// PendingBefore (to Debezium) is the pending rows the slot will never
	// stream: the relays must publish them before they stop. In a dry run
	// without a slot, every pending row.
	PendingBefore int64
	// Ready (to Debezium): PendingBefore is 0 and the switch is done; stop
	// the relays (Close), start the connector on Slot and a Tracker.
	Ready bool
	// Marked (to the relay) is the rows the last confirmed mark marked
	// published; Pending the rows left for the relays to publish (some
	// Debezium delivered after its last confirmed mark: duplicates, in
	// order).
	Marked, Pending int64
	// Next is what the operator does next.
	Next string
}

func captureSwitch(db postgres.DB, cfg *SwitchConfig) (storage.Pool, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return storage.PoolFrom(db)
}

// SwitchToDebezium moves the outbox in db's search_path from the relay to
// Debezium's connector, the first half of docs/operations.md ("Relaying
// with Debezium"): it creates the capture trigger and the insert-only
// publication (waiting for the writing transactions in flight), creates
// the replication slot and registers its boundary, then counts (and, with
// Wait, waits for) the pending rows inserted before the boundary: the
// slot never streams those, so the relays must publish them. It is
// idempotent: run it again until Ready. Then stop the relays, start the
// connector on the slot (snapshot.mode=no_data) and a Tracker.
//
// A row is judged by the transaction that inserted it (the capture
// trigger records it), never by its last update: a failed publish or any
// later change of a row from before the slot keeps it the relay's.
func SwitchToDebezium(ctx context.Context, db postgres.DB, cfg SwitchConfig) (SwitchReport, error) {
	pool, err := captureSwitch(db, &cfg)
	if err != nil {
		return SwitchReport{}, fmt.Errorf("capture.SwitchToDebezium: %w", err)
	}
	rep := SwitchReport{DryRun: cfg.DryRun}
	if rep.Before, err = readState(ctx, pool, cfg); err != nil {
		return rep, fmt.Errorf("capture.SwitchToDebezium: reading the capture state%s: %w", storage.Hint(err), err)
	}
	b := rep.Before
	if b.WALLevel != "logical" {
		return rep, fmt.Errorf("capture.SwitchToDebezium: wal_level is %q: set wal_level = logical (a server restart) before switching to Debezium", b.WALLevel)
	}
	step := func(done bool, what string) {
		if !done {
			rep.Steps = append(rep.Steps, what)
		}
	}
	step(b.Trigger, "create the capture trigger millwright_outbox_capture (waits for the writing transactions in flight)")
	step(b.Publication, fmt.Sprintf("create publication %q (inserts only)", cfg.Publication))
	step(b.SlotExists, fmt.Sprintf("create replication slot %q (pgoutput)", cfg.Slot))
	step(b.Registered, fmt.Sprintf("register slot %q's boundary (a snapshot taken after the slot exists)", cfg.Slot))
	if cfg.DryRun {
		if b.Registered {
			rep.PendingBefore, err = storage.CountPendingBeforeSlot(ctx, pool, cfg.Slot)
		} else {
			var st storage.OutboxStats
			st, err = storage.ReadOutboxStats(ctx, pool)
			rep.PendingBefore = st.Pending
		}
		if err != nil {
			return rep, fmt.Errorf("capture.SwitchToDebezium: counting pending rows: %w", err)
		}
		rep.Next = "run without the dry run; keep the relays running until it reports 0 rows pending before the slot"
		return rep, nil
	}
	if err := storage.EnableCapture(ctx, pool, cfg.Publication); err != nil {
		return rep, fmt.Errorf("capture.SwitchToDebezium: %w", err)
	}
	if _, err := storage.CreateCaptureSlot(ctx, pool, cfg.Slot); err != nil {
		return rep, fmt.Errorf("capture.SwitchToDebezium: %w", err)
	}
	deadline := time.Now().Add(cfg.Wait)
	for {
		if rep.PendingBefore, err = storage.CountPendingBeforeSlot(ctx, pool, cfg.Slot); err != nil {
			return rep, fmt.Errorf("capture.SwitchToDebezium: counting the pending rows from before slot %q: %w", cfg.Slot, err)
		}
		if rep.PendingBefore == 0 || !time.Now().Before(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return rep, fmt.Errorf("capture.SwitchToDebezium: waiting for the relays to publish %d row(s) from before slot %q: %w", rep.PendingBefore, cfg.Slot, ctx.Err())
		case <-time.After(cfg.PollInterval):
		}
	}
	rep.Ready = rep.PendingBefore == 0
	if rep.Ready {
		rep.Next = fmt.Sprintf("stop the relays (Close), then start the connector with slot.name=%s publication.name=%s snapshot.mode=no_data (deploy/debezium/outbox-connector.json) and a Tracker on slot %s", cfg.Slot, cfg.Publication, cfg.Slot)
	} else {
		rep.Next = fmt.Sprintf("keep the relays running: %d row(s) from before the slot are still pending (the slot never streams them); run the switch again (it is idempotent) until 0", rep.PendingBefore)
	}
	return rep, nil
}

// SwitchToRelay moves the outbox in db's search_path back from Debezium to
// the relay, the second half of docs/operations.md: with the connector
// stopped (it refuses while a connector streams from the slot, naming the
// fix), it marks published the rows the slot's last confirmed capture
// mark saw (the Tracker's rounds take the marks), drops the slot
// and its registration, the publication and the trigger. Then start the
// relays: they publish every row still pending, in order, including what
// Debezium delivered after its last confirmed mark (duplicates the
// idempotency middleware drops). Nothing is marked published that the
// connector did not confirm. Delete the connector before or after.
func SwitchToRelay(ctx context.Context, db postgres.DB, cfg SwitchConfig) (SwitchReport, error) {
	pool, err := captureSwitch(db, &cfg)
	if err != nil {
		return SwitchReport{}, fmt.Errorf("capture.SwitchToRelay: %w", err)
	}
	rep := SwitchReport{DryRun: cfg.DryRun}
	if rep.Before, err = readState(ctx, pool, cfg); err != nil {
		return rep, fmt.Errorf("capture.SwitchToRelay: reading the capture state%s: %w", storage.Hint(err), err)
	}
	b := rep.Before
	if b.SlotActive {
		return rep, fmt.Errorf("capture.SwitchToRelay: replication slot %q is active: a connector still streams it; stop the connector first "+
			"(PUT /connectors/<name>/stop: it commits its offsets and confirms its last position), then run the switch again", cfg.Slot)
	}
	if b.SlotExists && b.Registered {
		rep.Steps = append(rep.Steps, fmt.Sprintf("mark published the rows slot %q's last confirmed capture mark saw", cfg.Slot))
	}
	if b.SlotExists {
		rep.Steps = append(rep.Steps, fmt.Sprintf("drop replication slot %q", cfg.Slot))
	}
	if b.Registered {
		rep.Steps = append(rep.Steps, fmt.Sprintf("forget slot %q's boundary", cfg.Slot))
	}
	if b.Publication {
		rep.Steps = append(rep.Steps, fmt.Sprintf("drop publication %q", cfg.Publication))
	}
	if b.Trigger {
		rep.Steps = append(rep.Steps, "drop the capture trigger")
	}
	if !cfg.DryRun {
		if b.SlotExists && b.Registered {
			if rep.Marked, _, err = storage.MarkCaptured(ctx, pool, cfg.Slot); err != nil {
				return rep, fmt.Errorf("capture.SwitchToRelay: %w", err)
			}
		}
		if err := storage.DropCaptureSlot(ctx, pool, cfg.Slot); err != nil {
			return rep, fmt.Errorf("capture.SwitchToRelay: dropping replication slot %q (a connector that started again holds it: stop it): %w", cfg.Slot, err)
		}
		if err := storage.DisableCapture(ctx, pool, cfg.Publication); err != nil {
			return rep, fmt.Errorf("capture.SwitchToRelay: %w", err)
		}
	}
	st, err := storage.ReadOutboxStats(ctx, pool)
	if err != nil {
		return rep, fmt.Errorf("capture.SwitchToRelay: counting pending rows: %w", err)
	}
	rep.Pending = st.Pending
	if cfg.DryRun {
		rep.Next = "run without the dry run, then start the relays"
	} else {
		rep.Next = fmt.Sprintf("start the relays: they publish the %d pending row(s); delete the connector if not yet done", rep.Pending)
	}
	return rep, nil
}
