package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/schemacheck"
	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/tracing"
)

// Metadata keys of the copy of an event the relay sends to
// Config.DeadLetterTopic: package dlq's envelope (metadata.DeadLetter*),
// so that dlq.Store records it and `millwright dlq replay` sends it back.
const (
	// MetadataDeadLetterError holds the last publish error of the event.
	MetadataDeadLetterError = metadata.DeadLetterError
	// MetadataDeadLetterTopic holds the topic the event was meant for.
	MetadataDeadLetterTopic = metadata.DeadLetterOriginalTopic
)

// DefaultRetryBudget is Config.Retry.MaxElapsedTime's default: how
// long the relay retries a failing row, from its first failure, before the
// row becomes failed and its aggregate's later events go out ahead of it.
const DefaultRetryBudget = 15 * time.Minute

// Config configures a Relay. The zero value is valid.
type Config struct {
	// BatchSize is the most rows claimed, published and marked at a time.
	// Default 500; valid 1..10000.
	BatchSize int
	// PollInterval is how often the relay looks for rows when no
	// notification wakes it (and the wake-up for rows whose backoff ends).
	// It does not pace the relay's own failures (database unreachable, a
	// claim or mark failing): those back off from 100ms to 1s, with
	// jitter (see the package doc, "Guarantees"). Default 1s; minimum 1ms.
	PollInterval time.Duration
	// ListenURL is a Postgres URL on which the relay LISTENs for the
	// notifications the outbox's insert trigger sends at commit, so that
	// events go out without waiting out PollInterval. It must reach the
	// same database and search_path as the relay's pool (Run checks,
	// and polls if it does not), directly or through a session-pooling
	// proxy: the relay opens two connections on it, one for LISTEN and one
	// holding the wake-up lock while it is idle (a session advisory lock),
	// which a transaction-pooling PgBouncer breaks. On a *pgxpool.Pool
	// both are pgx connections (LISTEN with WaitForNotification), on a
	// *sql.DB lib/pq's. Default "" (polling only).
	ListenURL string
	// Lease is how long a relay's hold on its lanes lasts without renewal;
	// a relay renews it between rounds, once half spent. A relay that dies
	// keeps its lanes that long; one that stalls longer loses them to the
	// others. So nothing of a batch outlasts the lease it was claimed under
	// (see the package doc, "Guarantees"): its publish is cut a tenth of
	// Lease before the lanes' lease ends (about 0.4 x Lease or more after
	// the batch began: 12 s by default), the broker calls not answered by then
	// leave their rows pending, as they were, for whoever holds the lanes
	// next (the attempt is not a failure: it burns no retry budget), and
	// the marks write only rows of lanes the relay still holds. Lease also
	// bounds each statement of a batch published in the database and each
	// pause between them (statement_timeout,
	// idle_in_transaction_session_timeout). Raise it above the slowest
	// publish the broker has when healthy. Default 30s; minimum 1ms.
	Lease time.Duration
	// Retry is the backoff between publish attempts of a failing row, and
	// its budget: MaxElapsedTime, counted from the row's first failure
	// (first_failed_at), is how long a failing row is retried before it
	// becomes failed. Jitter stays inside the budget: the delays are cut so
	// that attempts go on until it has passed, whatever they drew, and the
	// attempt made once it has is the last (retry.Policy.Next); a row
	// fails only once its first failure is older than the budget. Default:
	// InitialInterval 500ms, MaxInterval 1m, MaxElapsedTime 15m (enough to
	// ride out a broker restart), full jitter, MaxAttempts -1 (no limit on
	// the number of attempts: the budget is the duration). MaxAttempts set
	// above 0 is an extra bound, whichever ends first (before this
	// release it was the only one, default 20: with full jitter a median
	// of 6.5 minutes, not the 15 documented). There is no way to retry a
	// row without a time limit but a very long MaxElapsedTime. A
	// failure.Permanent error fails the row at once.
	Retry retry.Policy
	// DeadLetterTopic, when set, receives a copy of every event that
	// spends its retry budget (or fails with a failure.Permanent error), with
	// package dlq's envelope (metadata.DeadLetter*: original topic, error,
	// attempts, handler DeadLetterHandler): a dlq.Store recording that topic
	// lists it beside the consumers' dead letters, and `millwright dlq
	// replay` sends it back to its original topic. The copy is sent once
	// per failure, after the statement recording the row failed commits
	// (a statement that fails sends none), and waits for the broker at
	// most Lease; a copy lost then (the broker refused it, the relay died
	// before sending it) is logged, not sent again. The row becomes failed
	// either way and stays in the table for `millwright outbox
	// retry-failed`. Default "": off, because the failed row already parks
	// the event where nothing is lost (millwright_outbox_failed_events and
	// the MillwrightOutboxFailed alert report it); set it to handle the
	// relay's failures with the same dead-letter tools as the consumers'.
	DeadLetterTopic string
	// Workers is how many batches the running relays of one outbox keep
	// in flight together while they have a backlog: each relay divides its
	// lanes into ceil(Workers / live relays) groups and claims, publishes
	// and marks a batch of up to BatchSize rows of each group at once, so
	// that one relay keeps both the database and the broker busy (the
	// claim and mark of one group run while another's publish does), and
	// more relays do not crowd a small database with more batches than
	// it has cores for. Each lane is in one group per round and a round
	// ends when every group's batch is marked, so each aggregate stays in
	// order. A relay keeping up with its writers (its last batch was not
	// full) claims all its lanes at once, one query per round. Default 4
	// (measured best on a 2-core machine holding the database and the
	// broker; raise it with the database's cores); valid 1..64.
	// Publishing in the database (the sql transport) uses one group.
	Workers int
	// PublishConcurrency is the number of concurrent Publish calls a batch
	// is split into (by aggregate) when the publisher has no PublishBatch.
	// Default 8; valid 1..1024.
	PublishConcurrency int
	// Registerer, when set, receives the relay's metrics (see the Metric
	// constants). Default nil: no metrics are registered.
	Registerer prometheus.Registerer
	// MetricsInterval is how often the backlog gauges are refreshed when
	// Registerer is set. Default 15s; minimum 10ms.
	MetricsInterval time.Duration
	// CloseTimeout bounds how long Close waits for the batch in flight
	// before cancelling it. Default 30s.
	CloseTimeout time.Duration
	// Logger. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// TracerProvider makes the relay's publish spans. Default nil: the
	// global otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
}

func (c *Config) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.Lease == 0 {
		c.Lease = 30 * time.Second
	}
	if c.Retry.InitialInterval == 0 {
		c.Retry.InitialInterval = 500 * time.Millisecond
	}
	if c.Retry.MaxInterval == 0 {
		c.Retry.MaxInterval = time.Minute
	}
	if c.Retry.MaxElapsedTime == 0 {
		c.Retry.MaxElapsedTime = DefaultRetryBudget
	}
	if c.Retry.MaxAttempts == 0 {
		c.Retry.MaxAttempts = -1 // the budget is MaxElapsedTime
	}
	c.Retry = c.Retry.WithDefaults()
	if c.PublishConcurrency == 0 {
		c.PublishConcurrency = 8
	}
	if c.Workers == 0 {
		c.Workers = 4
	}
	if c.MetricsInterval == 0 {
		c.MetricsInterval = 15 * time.Second
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, naming each.
func (c Config) Validate() error {
	var errs []error
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		errs = append(errs, fmt.Errorf("relay.Config.BatchSize %d: want 1..10000", c.BatchSize))
	}
	if c.PollInterval < time.Millisecond {
		errs = append(errs, fmt.Errorf("relay.Config.PollInterval %s: want at least 1ms", c.PollInterval))
	}
	if c.Lease < time.Millisecond {
		errs = append(errs, fmt.Errorf("relay.Config.Lease %s: want at least 1ms", c.Lease))
	}
	if c.Workers < 1 || c.Workers > 64 {
		errs = append(errs, fmt.Errorf("relay.Config.Workers %d: want 1..64", c.Workers))
	}
	if c.PublishConcurrency < 1 || c.PublishConcurrency > 1024 {
		errs = append(errs, fmt.Errorf("relay.Config.PublishConcurrency %d: want 1..1024", c.PublishConcurrency))
	}
	if c.MetricsInterval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("relay.Config.MetricsInterval %s: want at least 10ms", c.MetricsInterval))
	}
	if c.CloseTimeout < 0 {
		errs = append(errs, fmt.Errorf("relay.Config.CloseTimeout %s is negative", c.CloseTimeout))
	}
	if err := c.Retry.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("relay.Config.Retry: %w", err))
	}
	return errors.Join(errs...)
}

// Relay publishes committed outbox rows through a Watermill publisher. Any
// number of relays, in any number of processes, may run on one table: they
// divide its lanes between them (see the package doc).
type Relay struct {
	db    storage.Pool
	pub   message.Publisher
	batch batch.Publisher
	mover *mover // nil unless pub publishes in the database
	cfg   Config
	m     *metrics
	tr    tracing.Config
	stats relayStats
	run   *runner.Runner
	// guard recovers a panic of a broker call (per row, see call) or of
	// a round (the round fails and is retried), so that none ends Run.
	guard *runner.Guard
	id    string // in millwright_outbox_relays

	ready     chan struct{} // Running
	readyOnce sync.Once

	// roundMu makes rounds (Run's and RunOnce's) take turns; runLanes are
	// Run's lanes while it runs.
	roundMu  sync.Mutex
	runLanes *lanes

	rates laneRates // how the claim divides a batch over the lanes

	// schema and oid of the outbox table, and the connection holding the
	// wake-up lock while the relay is idle; set once LISTEN works (only
	// Run's goroutine reads them).
	schema   string
	tableOID uint32
	waitDB   storage.Pool
	// wakeLock is the wake-up lock (see announceIdle), built once by
	// listen; holdGuard: the server has idle_session_timeout (Postgres
	// 14+), set while the wake-up lock is held.
	wakeLock  storage.WakeLock
	holdGuard bool

	// afterPublish, when set (tests), runs after the broker calls of a batch
	// and before the rows are marked.
	afterPublish func(ctx context.Context, published []int64)
	// groupSpan, when set (tests), replaces laneCheckEvery as the longest
	// a group works on alone in a round (see inGroups).
	groupSpan time.Duration
	// beforeIdleLook, when set (tests), runs after announceIdle and before
	// the look at the table that follows it.
	beforeIdleLook func()
	// crashed, when set (tests), makes Run return without giving its
	// lanes back, as a relay that dies does.
	crashed atomic.Bool
	// lanesLent counts the lanes this relay lent to spare relays.
	lanesLent atomic.Int64
	// lanesChanged: a notification said lanes changed hands (or the
	// LISTEN reconnected, and one may have been missed).
	lanesChanged atomic.Bool
	// stuck counts the broker calls still running that the relay stopped
	// waiting for at their batch's bound (a publisher that does not stop
	// at its messages' context): while there are any, the relay holds no
	// lanes (see standAside).
	stuck atomic.Int64
	// cutBatches counts the batches whose publish the bound cut short.
	cutBatches atomic.Int64
	// fails paces Run after its own failures (its start check and its
	// rounds), idleFails logs the wake-up lock's (see failures); only
	// Run's goroutine uses them.
	fails, idleFails *failures
}

// relayTables are the tables a relay works on: Run checks they exist
// before it starts.
var relayTables = []string{"millwright_outbox", "millwright_outbox_lanes", "millwright_outbox_relays"}

// New returns a relay reading the outbox through db (a *sql.DB or a
// *pgxpool.Pool) and publishing with pub. When pub also has PublishBatch
// (transport.BatchPublisher), each batch goes out in one call per topic.
// The relay does not close pub.
func New(db postgres.DB, pub message.Publisher, cfg Config) (*Relay, error) {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("relay.New: %w", err)
	}
	return newRelay(pool, pub, cfg)
}

func newRelay(db storage.Pool, pub message.Publisher, cfg Config) (*Relay, error) {
	if pub == nil {
		return nil, errors.New("relay.New: nil publisher: pass the transport's message.Publisher")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("outbox: registering relay metrics: %w", err)
	}
	r := &Relay{db: db, pub: pub, cfg: cfg, m: m, run: runner.New("outbox.Relay", cfg.CloseTimeout),
		tr: tracing.Config{TracerProvider: cfg.TracerProvider}, id: watermill.NewUUID(), ready: make(chan struct{}),
		fails: newFailures(cfg.Logger, cfg.Lease), idleFails: newFailures(cfg.Logger, cfg.Lease)}
	if r.guard, err = runner.NewGuard("outbox.Relay", cfg.Registerer, cfg.Logger); err != nil {
		return nil, fmt.Errorf("outbox: registering relay metrics: %w", err)
	}
	if bp, ok := pub.(batch.Publisher); ok {
		r.batch = bp
	}
	if ip, ok := pub.(sqlschema.Publisher); ok {
		r.mover = newMover(db, ip, &r.cfg, m, &r.stats, r.tr, &r.rates)
	}
	return r, nil
}

// Running is closed once Run is listening and about to claim its first batch.
func (r *Relay) Running() <-chan struct{} { return r.ready }

func (r *Relay) markReady() { r.readyOnce.Do(func() { close(r.ready) }) }

// Close stops Run after the batch in flight, waiting at most CloseTimeout
// before cancelling it. It is idempotent and safe to call before Run.
func (r *Relay) Close() error { return r.run.Close() }

// Run publishes rows until ctx is cancelled or Close is called. Cancelling
// ctx stops at once: rows of the batch in flight that were published but
// not marked are published again by the relay that takes their lane. Close
// lets that batch finish. Run may be called once.
//
// Run first checks that the outbox's tables exist in the search_path of
// the relay's pool and returns an error naming those missing (and the
// fix: `millwright migrate`) if they do not; while the database cannot be
// asked, it retries. Failures of its own (the database unreachable, the
// lane check, the claim or the marks failing) are retried with a backoff
// of at most a second, drawn with jitter, and logged once and then at most
// every 10 seconds with the count since (see DESIGN.md, "When the relay
// fails"); the first round that works ends the backoff.
func (r *Relay) Run(ctx context.Context) error {
	defer r.markReady() // Close before Run: Run returns at once
	return r.run.Run(ctx, func(ctx context.Context, draining <-chan struct{}) error {
		if ok, err := r.checkTables(ctx, draining); !ok {
			return err
		}
		wake := make(chan struct{}, 1)
		if r.cfg.ListenURL != "" {
			stop, err := r.listen(ctx, wake)
			if err != nil {
				r.cfg.Logger.Error("outbox relay: LISTEN failed, polling only", err, watermill.LogFields{"poll_interval": r.cfg.PollInterval})
			} else {
				defer stop()
			}
		}
		if r.cfg.Registerer != nil {
			var wg sync.WaitGroup
			defer wg.Wait()
			rctx, cancel := context.WithCancel(ctx)
			defer cancel()
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.refreshLoop(rctx)
			}()
		}
		r.roundMu.Lock()
		r.runLanes = &lanes{db: r.db, id: r.id, lease: r.cfg.Lease, member: true, quick: true}
		if r.schema != "" {
			r.runLanes.notify = NotifyChannel(r.schema)
		}
		r.runLanes.onLend = func(lent []int32) {
			r.lanesLent.Add(int64(len(lent)))
			r.cfg.Logger.Debug("outbox relay: lent lanes to a spare relay", watermill.LogFields{"lanes": lent})
		}
		r.roundMu.Unlock()
		defer r.leave(ctx)
		r.markReady()
		r.loop(ctx, draining, wake)
		if n := r.stuck.Load(); n > 0 {
			// Run does not wait for them (they ignore their deadline and
			// may never return), but it does not hide them either.
			return fmt.Errorf("outbox relay: stopped with %d broker call(s) still running past their batch's bound (the publisher does not stop at its messages' context deadline): "+
				"their rows stay pending and are republished after the lease by the relay that takes their lanes", n)
		}
		return nil
	})
}

// checkTables checks that the relay's tables exist, retrying while the
// database cannot be asked. It returns false when Run should return err:
// tables are missing (err says which), or the relay was stopped (nil).
func (r *Relay) checkTables(ctx context.Context, draining <-chan struct{}) (bool, error) {
	for {
		// Bounded: a server that accepts connections and never answers
		// would otherwise hold Run here, silent, until shutdown.
		cctx, cancel := context.WithTimeout(ctx, r.cfg.Lease)
		err := schemacheck.Check(cctx, r.db, "outbox relay", relayTables...)
		if err == nil {
			err = r.checkColumns(cctx)
		}
		cancel()
		var missing *schemacheck.MissingError
		switch {
		case err == nil:
			r.fails.ok("outbox relay")
			return true, nil
		case errors.As(err, &missing), errors.Is(err, errMigrationMissing):
			return false, err
		case ctx.Err() != nil:
			return false, nil
		}
		if !runner.Wait(ctx, draining, r.fails.failed("outbox relay: checking its tables at start failed", err)) {
			return false, nil
		}
	}
}

// errMigrationMissing is wrapped by checkColumns' error when a migration
// this relay needs was not applied.
var errMigrationMissing = errors.New("a migration this relay needs was not applied")

// checkColumns checks that the outbox has the columns of the newest
// migration this relay's statements use (007's first_failed_at): a relay
// on a database migrated before it would otherwise fail every round.
func (r *Relay) checkColumns(ctx context.Context) error {
	err := storage.CheckOutboxColumns(ctx, r.db)
	if storage.Code(err) == "42703" { // undefined_column
		return fmt.Errorf("outbox relay: millwright_outbox has no column first_failed_at (outbox migration 007): %w: run `millwright migrate` of this version on the service's database", errMigrationMissing)
	}
	return err
}

// leave gives Run's lanes back. On a cancelled ctx it still tries, briefly:
// otherwise the lanes wait for their leases to end.
func (r *Relay) leave(ctx context.Context) {
	r.roundMu.Lock()
	defer r.roundMu.Unlock()
	if r.crashed.Load() {
		r.runLanes = nil
		return
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := r.runLanes.free(fctx); err != nil {
		r.cfg.Logger.Error("outbox relay: leaving", err, nil)
	}
	r.runLanes = nil
}

// roundResult is what one round did.
type roundResult struct {
	n        int       // rows claimed
	next     time.Time // earliest backoff scheduled
	failures int       // rows whose publish failed
	more     bool      // some held lanes may have more due rows: the batch was full
	waiting  bool      // lanes of its share are held by others: check again soon
	// awaitingLoan: nothing was due in its lanes while another relay's
	// batch was full; it checks again soon for lanes lent to it.
	awaitingLoan bool
	perLane      map[int32]int // rows claimed per lane
	err          error
}

// perLane counts rows by lane (roundResult.perLane, for lending).
func perLane(rows []row) map[int32]int {
	m := make(map[int32]int, laneCount)
	for _, rw := range rows {
		m[rw.lane]++
	}
	return m
}

// loop runs rounds back to back while batches come back full, and
// otherwise waits for a notification, the poll interval or the earliest
// backoff.
func (r *Relay) loop(ctx context.Context, draining <-chan struct{}, wake <-chan struct{}) {
	var due time.Time // earliest end of a backoff this relay scheduled
	busy := false     // the last batch came back full: work the lanes in groups
	for runner.Wait(ctx, draining, 0) {
		res := r.guardedRound(ctx, r.runLanes, nil, busy)
		busy = res.more && res.err == nil
		if ctx.Err() != nil {
			return
		}
		backoff := r.noteRound(res)
		due = earliest(due, res.next)
		if res.more && res.err == nil {
			continue
		}
		if !r.idle(ctx, draining, wake, res, &due, backoff) {
			return
		}
		if r.lanesChanged.Swap(false) {
			r.recheckLanes()
		}
	}
}

// recheckLanes makes the next round check the lanes first, although the
// last check is less than laneCheckEvery old: a relay notified that lanes
// changed hands (lanesNotice) takes or frees them before it looks for what
// woke it. (After a longer sleep the check is due anyway.)
func (r *Relay) recheckLanes() {
	r.roundMu.Lock()
	defer r.roundMu.Unlock()
	if r.runLanes != nil {
		r.runLanes.checked = time.Time{}
	}
}

// idle waits for work after a round that did not fill its batch, or
// backoff after a round that failed. It returns false when the relay
// should stop.
func (r *Relay) idle(ctx context.Context, draining <-chan struct{}, wake <-chan struct{}, res roundResult, due *time.Time, backoff time.Duration) bool {
	if backoff > 0 {
		return r.backOff(ctx, draining, backoff, due)
	}
	listening := r.schema != ""
	if res.n > 0 && res.err == nil && !listening {
		return true
	}
	// Sleep no longer than a third of the lease, or the relay's lanes
	// would go to the others while it waits.
	wait := min(r.cfg.PollInterval, r.cfg.Lease/3)
	if res.waiting || res.awaitingLoan {
		wait = min(wait, laneWaitCheckEvery)
	}
	release := func(bool) {}
	// A relay awaiting a loan looks again within laneWaitCheckEvery and
	// the full relays are busy: writers need not notify anybody.
	if listening && res.err == nil && !res.awaitingLoan {
		var work, settled bool
		release, work, settled, backoff = r.lookUnderLock(ctx, due)
		if ctx.Err() != nil {
			return false
		}
		if work {
			return true
		}
		if backoff > 0 { // that round failed (and gave the lock back)
			return r.backOff(ctx, draining, backoff, due)
		}
		if !settled {
			// A writer that may have missed the request is still in its
			// transaction: look again soon.
			wait = min(wait, idleRecheck)
		}
	}
	if !due.IsZero() {
		wait = max(min(wait, time.Until(*due)), 0)
	}
	return r.sleep(ctx, draining, wake, wait, release, due)
}

// sleep waits wait, or for a notification, then calls release (with
// handOver when the relay stops) and returns false if it should stop.
func (r *Relay) sleep(ctx context.Context, draining, wake <-chan struct{}, wait time.Duration, release func(bool), due *time.Time) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		release(true)
		return false
	case <-draining:
		release(true)
		return false
	case <-wake:
	case <-t.C:
	}
	release(false)
	if !due.IsZero() && !time.Now().Before(*due) {
		*due = time.Time{}
	}
	return true
}

// backOff waits d after a failure of the relay's own. A notification
// does not end the wait: a relay failing while its database works (a
// statement that keeps failing) would otherwise retry at every commit.
// The notification is not lost; the round after the wait looks anyway,
// and claims the rows whose backoff (due) ended meanwhile.
func (r *Relay) backOff(ctx context.Context, draining <-chan struct{}, d time.Duration, due *time.Time) bool {
	if !runner.Wait(ctx, draining, d) {
		return false
	}
	if !due.IsZero() && !time.Now().Before(*due) {
		*due = time.Time{}
	}
	return true
}

// lookUnderLock asks writers for a NOTIFY (announceIdle), then runs one
// more round: rows committed before the request went unannounced. work:
// that round found rows (the lock is given back before they are
// published, or writers would notify while this relay is busy); settled:
// see announceIdle. release gives the lock back when the relay wakes.
// backoff is set when that round failed: how long to wait (noteRound).
func (r *Relay) lookUnderLock(ctx context.Context, due *time.Time) (release func(bool), work, settled bool, backoff time.Duration) {
	release, settled, err := r.announceIdle(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		// The wake-up connection is failing: poll at PollInterval until
		// it works again.
		r.idleFails.failed("outbox relay: announcing idleness failed, polling at the poll interval ("+r.cfg.PollInterval.String()+")", err)
		settled = true
	case err == nil:
		r.idleFails.ok("outbox relay: announcing idleness")
	}
	if r.beforeIdleLook != nil {
		r.beforeIdleLook()
	}
	again := r.guardedRound(ctx, r.runLanes, func() { release(false) }, false)
	if again.err != nil {
		release(false)
	}
	if ctx.Err() != nil {
		release(true)
		return release, false, settled, 0
	}
	backoff = r.noteRound(again)
	*due = earliest(*due, again.next)
	return release, again.n > 0 && again.err == nil, settled, backoff
}

// noteRound paces and logs Run's rounds: after a failed round it returns
// the backoff to wait (r.fails: logged once, then at most every
// failureLogEvery), after one that worked 0, ending a run of failures.
func (r *Relay) noteRound(res roundResult) time.Duration {
	if res.err == nil {
		r.fails.ok("outbox relay")
		return 0
	}
	return max(r.fails.failed("outbox relay: batch failed", res.err), time.Nanosecond)
}

// earliest returns the earlier of two times, the zero time meaning none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// RunOnce claims, publishes and marks one batch and returns the number of
// rows it claimed (0: nothing was due). It is for tools, benchmarks and
// tests that drive a relay step by step; a service calls Run. Outside Run
// it publishes the lanes no running relay holds. RunOnce is safe to call
// concurrently with itself and with Run.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	r.roundMu.Lock()
	l := r.runLanes
	r.roundMu.Unlock()
	if l != nil {
		res := r.guardedRound(ctx, l, nil, false)
		return res.n, res.err
	}
	l = &lanes{db: r.db, id: r.id + "/once", lease: r.cfg.Lease}
	res := r.guardedRound(ctx, l, nil, false)
	// Bounded as a lane check: lanes not freed are free once their lease
	// ends.
	fctx, cancel := context.WithTimeout(ctx, r.cfg.Lease)
	defer cancel()
	if err := l.free(fctx); err != nil && res.err == nil {
		res.err = err
	}
	return res.n, res.err
}

// guardedRound is round with a panic recovered (logged, counted in
// MetricLoopPanics): the round fails, Run backs off and runs the next. A
// publisher's panic on a row is handled per row (call); this catches the
// rest, wherever in the round it happens.
func (r *Relay) guardedRound(ctx context.Context, l *lanes, claimed func(), grouped bool) roundResult {
	var res roundResult
	if err := r.guard.Do("in a round", nil, func() error {
		res = r.round(ctx, l, claimed, grouped)
		return nil
	}); err != nil {
		return roundResult{err: err}
	}
	return res
}

// round runs the relay's three stages on the lanes it holds: claim →
// publish → mark (in one transaction, when the mover publishes in the
// database); with grouped set, on up to Workers groups of the lanes at
// once (see Config.Workers). claimed, if not nil, runs once rows are
// claimed, before they are published.
func (r *Relay) round(ctx context.Context, l *lanes, claimed func(), grouped bool) (res roundResult) {
	r.roundMu.Lock()
	defer r.roundMu.Unlock()
	defer func() { r.stats.endRound(res.failures, res.err) }()
	if l == nil { // Run ended meanwhile
		return roundResult{}
	}
	defer func() {
		l.report(res)
		res.awaitingLoan = l.awaitingLoan()
	}()
	if n := r.stuck.Load(); n > 0 {
		return r.standAside(ctx, l, n)
	}
	l.aside = false
	// A lane check that hangs (a lock, a server that stopped answering)
	// ends with a lease: by then the lanes are no longer this relay's
	// anyway, and the next round checks again.
	hctx, cancel := context.WithTimeout(ctx, r.cfg.Lease)
	held, err := l.hold(hctx)
	cancel()
	if err != nil {
		// Run backs off (noteRound); RunOnce's caller decides.
		return roundResult{err: err}
	}
	lease := batchLease{owner: l.id, until: l.validUntil}
	res.waiting = l.waiting
	if len(held) == 0 {
		return res
	}
	if r.mover != nil {
		n, perLane, ok, err := r.mover.tryMove(ctx, held)
		if ok && n > 0 && claimed != nil {
			claimed()
		}
		if ok {
			res.n, res.more, res.perLane, res.err = n, n >= r.cfg.BatchSize, perLane, err
			return res
		}
	}
	if !grouped {
		return r.stages(ctx, lease, held, claimed, res)
	}
	groups := laneGroups(held, (r.cfg.Workers+max(l.relays, 1)-1)/max(l.relays, 1))
	if len(groups) == 1 {
		return r.stages(ctx, lease, held, claimed, res)
	}
	return r.inGroups(ctx, lease, groups, claimed, res)
}

// standAside gives the lanes up while n broker calls the relay stopped
// waiting for are still running (stuck): their messages may still reach
// the broker, so their lanes go to relays whose publishes end, and this
// relay publishes nothing, piling up no more such calls, until they have
// returned. Then its next round takes its share again.
func (r *Relay) standAside(ctx context.Context, l *lanes, n int64) roundResult {
	err := fmt.Errorf("outbox relay: %d broker call(s) still running after their batch's bound (the publisher does not stop at its messages' context deadline); "+
		"this relay holds no lanes until they return, and the other relays publish its share", n)
	if !l.aside || len(l.held) > 0 {
		fctx, cancel := context.WithTimeout(ctx, r.cfg.Lease) // a hung server must not hold the relay here
		ferr := l.free(fctx)
		cancel()
		if ferr != nil {
			return roundResult{err: errors.Join(err, ferr)}
		}
		l.aside = true
		l.checked, l.validUntil = time.Time{}, time.Time{}
		r.cfg.Logger.Error("outbox relay: standing aside", err, nil)
	}
	return roundResult{err: err}
}

// inGroups runs the groups of the held lanes at once, each with
// groupStages, and adds up what they did to res.
func (r *Relay) inGroups(ctx context.Context, lease batchLease, groups [][]int32, claimed func(), res roundResult) roundResult {
	var once sync.Once
	if claimed != nil {
		c := claimed
		claimed = func() { once.Do(c) }
	}
	// Each group works its lanes batch after batch until its batch is not
	// full or the next lane check is due: the groups meet (and the lanes
	// may change hands) once per check, not after every batch, so one
	// slow publish does not hold the other groups back each time.
	span := laneCheckEvery
	if r.groupSpan > 0 {
		span = r.groupSpan
	}
	until := time.Now().Add(span)
	if by := r.publishBound(lease); by.Before(until) {
		until = by
	}
	results := make([]roundResult, len(groups))
	var wg sync.WaitGroup
	for i, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A goroutine of its own: a panic here would end the process
			// before the round's guard could see it.
			if err := r.guard.Do("in a group of lanes", watermill.LogFields{"lanes": g}, func() error {
				results[i] = r.groupStages(ctx, lease, g, claimed, until)
				return nil
			}); err != nil {
				results[i] = roundResult{err: err}
			}
		}()
	}
	wg.Wait()
	for _, g := range results {
		res.add(g)
	}
	return res
}

// add adds what batch or group b did to res: rows, failures and rows per
// lane summed, more if either may have more, the earlier backoff, both
// errors.
func (res *roundResult) add(b roundResult) {
	if len(b.perLane) > 0 && res.perLane == nil {
		res.perLane = make(map[int32]int, len(b.perLane))
	}
	for lane, n := range b.perLane {
		res.perLane[lane] += n
	}
	res.n += b.n
	res.more = res.more || b.more
	res.next = earliest(res.next, b.next)
	res.failures += b.failures
	res.err = errors.Join(res.err, b.err)
}

// groupStages runs stages on a group of the held lanes, batch after batch,
// while its batches come back full, without failures, and until has not
// passed. A group's lanes are its own for the round, and each batch is
// marked before the next is claimed, so each lane's rows go out in order.
func (r *Relay) groupStages(ctx context.Context, lease batchLease, g []int32, claimed func(), until time.Time) roundResult {
	var res roundResult
	for {
		b := r.stages(ctx, lease, g, claimed, roundResult{})
		res.add(b)
		res.more = b.more // the earlier batches were full; this one says
		if !b.more || b.err != nil || b.failures > 0 || ctx.Err() != nil || !time.Now().Before(until) {
			return res
		}
	}
}

// batchLease is what a batch is claimed under: the owner of its lanes in
// millwright_outbox_lanes (the relay, or its RunOnce), and a time no later
// than the end of their leases, from the relay's last lane check.
type batchLease struct {
	owner string
	until time.Time
}

// publishBound is when a batch's publish is cut: a tenth of Lease before
// its lanes' lease ends, what it then has to return and be marked.
func (r *Relay) publishBound(lease batchLease) time.Time {
	return lease.until.Add(-r.cfg.Lease / 10)
}

// stages is claim → publish → mark of one batch of the lanes held, every
// step bounded by the lanes' lease: the claim and the marks end with it
// (the marks also write only rows of lanes still held), the publish a
// tenth of Lease earlier (see Config.Lease). A batch whose bound has
// passed is not claimed (more: the next round's lane check renews the
// leases).
func (r *Relay) stages(ctx context.Context, lease batchLease, held []int32, claimed func(), res roundResult) roundResult {
	by := r.publishBound(lease)
	if !time.Now().Before(by) {
		res.more = true
		return res
	}
	lctx, cancel := context.WithDeadline(ctx, lease.until)
	defer cancel()
	rows, err := r.claim(lctx, held)
	if err != nil || len(rows) == 0 {
		res.err = err
		return res
	}
	if claimed != nil {
		claimed()
	}
	res.n, res.more = len(rows), len(rows) >= r.cfg.BatchSize
	res.perLane = perLane(rows)
	pctx, pcancel := context.WithDeadlineCause(lctx, by, errLeaseEnded)
	results := r.publish(pctx, rows, r.cfg.Lease/20)
	pcancel()
	res.next, res.failures, res.err = r.mark(lctx, ctx, lease, rows, results)
	return res
}

// laneGroups splits the held lanes into at most n groups of nearly equal
// size (lane i of the list into group i mod n), keeping their order.
func laneGroups(held []int32, n int) [][]int32 {
	n = max(min(n, len(held)), 1)
	groups := make([][]int32, n)
	for i, l := range held {
		groups[i%n] = append(groups[i%n], l)
	}
	return groups
}
