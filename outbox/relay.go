package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/tracing"
)

// Metadata keys the relay adds to the copy of an event it sends to
// RelayConfig.DeadLetterTopic.
const (
	// MetadataDeadLetterError holds the last publish error of the event.
	MetadataDeadLetterError = "outbox_last_error"
	// MetadataDeadLetterTopic holds the topic the event was meant for.
	MetadataDeadLetterTopic = "outbox_topic"
)

// batchPublisher has the method set of transport.BatchPublisher; the relay
// uses it when the publisher has it. It is declared here so that the outbox
// does not import every transport through package transport.
type batchPublisher interface {
	PublishBatch(topic string, msgs ...*message.Message) error
}

// RelayConfig configures a Relay. The zero value is valid.
type RelayConfig struct {
	// BatchSize is the most rows claimed, published and marked at a time.
	// Default 500; valid 1..10000.
	BatchSize int
	// PollInterval is how often the relay looks for rows when no
	// notification wakes it (and the wake-up for rows whose backoff ends).
	// Default 1s; minimum 1ms.
	PollInterval time.Duration
	// ListenURL is a Postgres URL on which the relay LISTENs for the
	// notifications the outbox's insert trigger sends at commit, so that
	// events go out without waiting out PollInterval. It must reach the
	// same database and search_path as the relay's *sql.DB (Run checks,
	// and polls if it does not), directly or through a session-pooling
	// proxy: the relay opens two connections on it, one for LISTEN and one
	// holding the wake-up lock while it is idle (a session advisory lock),
	// which a transaction-pooling PgBouncer breaks. Default "" (polling
	// only).
	ListenURL string
	// Lease is how long claimed rows stay reserved for this relay. A relay
	// that dies mid-batch delays its rows by at most Lease; they are then
	// claimed again and republished. It must exceed the slowest publish of
	// a batch, or another relay republishes rows still in flight
	// (duplicates, never losses). When the relay publishes in the database
	// (see the package doc) there is no lease column: Lease bounds each
	// statement of the batch's transaction and each pause between them
	// (statement_timeout, idle_in_transaction_session_timeout). Default
	// 30s; minimum 1ms.
	Lease time.Duration
	// Retry is the backoff between publish attempts of a failing row.
	// Default: InitialInterval 500ms, MaxInterval 1m, MaxAttempts 20 (about
	// 15 minutes of retrying, enough to ride out a broker restart), full
	// jitter. MaxElapsedTime counts from the row's creation.
	Retry retry.Policy
	// DeadLetterTopic, when set, receives a copy of every event that
	// exhausts its attempts, with MetadataDeadLetterError and
	// MetadataDeadLetterTopic added. The row becomes failed either way and
	// stays in the table for `millwright outbox retry-failed`. Default ""
	// (rows are only marked failed).
	DeadLetterTopic string
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
}

func (c *RelayConfig) setDefaults() {
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
	if c.Retry.MaxAttempts == 0 {
		c.Retry.MaxAttempts = 20
	}
	c.Retry = c.Retry.WithDefaults()
	if c.PublishConcurrency == 0 {
		c.PublishConcurrency = 8
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

// Validate reports the first invalid field, naming it.
func (c RelayConfig) Validate() error {
	var errs []error
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.BatchSize %d: want 1..10000", c.BatchSize))
	}
	if c.PollInterval < time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.PollInterval %s: want at least 1ms", c.PollInterval))
	}
	if c.Lease < time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.Lease %s: want at least 1ms", c.Lease))
	}
	if c.PublishConcurrency < 1 || c.PublishConcurrency > 1024 {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.PublishConcurrency %d: want 1..1024", c.PublishConcurrency))
	}
	if c.MetricsInterval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.MetricsInterval %s: want at least 10ms", c.MetricsInterval))
	}
	if c.CloseTimeout < 0 {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.CloseTimeout %s is negative", c.CloseTimeout))
	}
	if err := c.Retry.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("outbox: RelayConfig.Retry: %w", err))
	}
	return errors.Join(errs...)
}

// Relay publishes committed outbox rows through a Watermill publisher. Any
// number of relays, in any number of processes, may run on one table.
type Relay struct {
	db    *sql.DB
	pub   message.Publisher
	batch batchPublisher
	cfg   RelayConfig
	m     *metrics
	stats relayStats

	started   atomic.Bool
	running   chan struct{}
	closing   chan struct{}
	closeOnce sync.Once
	done      chan struct{}

	mu     sync.Mutex
	cancel context.CancelFunc

	stmtMu   sync.Mutex
	stmt     *sql.Stmt // claimSQL
	moveStmt *sql.Stmt // moveSQL

	// inDB is pub when it can publish in the database (transport sql); see
	// canMove. moveSame: 0 not checked yet, 1 same database as the
	// outbox's, -1 another.
	inDB         inDatabasePublisher
	moveMu       sync.Mutex
	moveSame     int
	moveOffUntil time.Time
	movable      map[string]struct{} // topics prepared with inDB.PrepareTopic
	moveLeaseSQL string              // a move's transaction settings (see move)

	// schema and oid of the outbox table, and the connection holding the
	// wake-up lock while the relay is idle; set once LISTEN works (only
	// Run's goroutine reads them).
	schema   string
	tableOID uint32
	waitDB   *sql.DB
	// holdGuard: the server has idle_session_timeout (Postgres 14+), set
	// while the wake-up lock is held.
	holdGuard bool
	// The wake-up lock's statements (see announceIdle), built once by
	// listen.
	tryLockSQL, unlockSQL, handOverSQL string

	// beforeMoveCommit, when set (tests), runs in move after the inserts,
	// before the commit.
	beforeMoveCommit func()
	// afterPublish, when set (tests), runs after the broker calls of a batch
	// and before the rows are marked.
	afterPublish func(ctx context.Context, published []int64)
	// beforeIdleLook, when set (tests), runs after announceIdle and before
	// the look at the table that follows it.
	beforeIdleLook func()
}

// NewRelay returns a relay reading the outbox through db and publishing with
// pub. When pub also has PublishBatch (transport.BatchPublisher), each batch
// goes out in one call per topic. The relay does not close pub.
func NewRelay(db *sql.DB, pub message.Publisher, cfg RelayConfig) (*Relay, error) {
	if db == nil {
		return nil, errors.New("outbox: NewRelay: nil *sql.DB")
	}
	if pub == nil {
		return nil, errors.New("outbox: NewRelay: nil publisher: pass the transport's message.Publisher")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("outbox: registering relay metrics: %w", err)
	}
	r := &Relay{
		db:      db,
		pub:     pub,
		cfg:     cfg,
		m:       m,
		running: make(chan struct{}),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}
	if bp, ok := pub.(batchPublisher); ok {
		r.batch = bp
	}
	if ip, ok := pub.(inDatabasePublisher); ok {
		r.inDB = ip
		ms := strconv.FormatInt(cfg.Lease.Milliseconds(), 10)
		r.moveLeaseSQL = "SET LOCAL statement_timeout = " + ms + "; SET LOCAL idle_in_transaction_session_timeout = " + ms +
			"; SET LOCAL synchronous_commit = off" // see move
	}
	return r, nil
}

// Running is closed once Run is listening and about to claim its first batch.
func (r *Relay) Running() <-chan struct{} { return r.running }

// Run publishes rows until ctx is cancelled or Close is called. Cancelling
// ctx stops at once: rows of the batch in flight that were published but
// not marked are republished by the next relay after Lease. Close lets that
// batch finish. Run may be called once.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called twice: create one Relay per Run")
	}
	defer close(r.done)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r.mu.Lock()
	r.cancel = cancel
	r.mu.Unlock()

	select {
	case <-r.closing:
		close(r.running)
		return nil
	default:
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
	var wg sync.WaitGroup
	defer func() {
		cancel() // stops the refresh loop; Close does not cancel ctx
		wg.Wait()
	}()
	if r.cfg.Registerer != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.refreshLoop(ctx)
		}()
	}
	close(r.running)

	var due time.Time // earliest end of a backoff this relay scheduled
	listening := r.schema != ""
	var ahead <-chan claimed // a batch claimed while the last was published
	// heldWait is how long to wait while other relays hold every due row
	// this one could take (see move): it doubles from idleRecheck up to
	// maxHeldWait (or PollInterval, if shorter) while that lasts.
	var heldWait time.Duration
	// A second mover while the backlog is deep (see help); waited for
	// before ctx is cancelled, so that its batch finishes on Close.
	var helper sync.WaitGroup
	var helping atomic.Bool
	var helpAfter atomic.Int64 // no helper before this time (unix ns)
	defer helper.Wait()
	defer func() {
		// Close drains: a batch claimed ahead is published before Run
		// returns rather than left leased until the lease expires. On a
		// cancelled ctx it stays leased and is republished after Lease.
		if ahead != nil {
			if c := <-ahead; len(c.rows) > 0 && ctx.Err() == nil {
				_, failures, err := r.process(ctx, c.rows)
				r.stats.endRound(failures, err)
				if err != nil {
					r.cfg.Logger.Error("outbox relay: last batch failed", err, nil)
				}
			}
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.closing:
			return nil
		default:
		}
		var rows []row
		var moved, failures int
		var held bool
		var err error
		if ahead != nil {
			c := <-ahead
			rows, err, ahead = c.rows, c.err, nil
		}
		if len(rows) == 0 && err == nil {
			// Nothing claimed ahead says little: it ran while the last
			// batch still held its aggregates.
			rows, moved, held, err = r.take(ctx)
		}
		n := len(rows) + moved
		if n > 0 {
			heldWait = 0
		}
		if moved >= r.cfg.BatchSize && err == nil && time.Now().UnixNano() > helpAfter.Load() && helping.CompareAndSwap(false, true) {
			helper.Add(1)
			go func() {
				defer helper.Done()
				defer helping.Store(false)
				if !r.help(ctx) {
					helpAfter.Store(time.Now().Add(helpCooldown).UnixNano())
				}
			}()
		}
		var next time.Time
		if len(rows) > 0 {
			if n >= r.cfg.BatchSize && err == nil {
				ahead = r.prefetch(ctx) // more is likely due: claim it meanwhile
			}
			next, failures, err = r.process(ctx, rows)
		}
		if ctx.Err() != nil {
			return nil
		}
		r.stats.endRound(failures, err)
		if err != nil {
			r.cfg.Logger.Error("outbox relay: batch failed, retrying after the poll interval", err, nil)
		}
		if !next.IsZero() && (due.IsZero() || next.Before(due)) {
			due = next
		}
		if n >= r.cfg.BatchSize && err == nil {
			continue
		}
		wait := r.cfg.PollInterval
		if n > 0 && err == nil && !listening {
			continue
		}
		release := func(bool) {}
		if listening && err == nil {
			// Ask writers for a NOTIFY, then look once more: rows
			// committed before the request went unannounced.
			var settled bool
			var aerr error
			release, settled, aerr = r.announceIdle(ctx)
			if aerr != nil && ctx.Err() == nil {
				// The wake-up connection is failing: poll at
				// PollInterval until it works again.
				r.cfg.Logger.Error("outbox relay: announcing idleness failed, polling", aerr, nil)
				settled = true
			}
			if r.beforeIdleLook != nil {
				r.beforeIdleLook()
			}
			var rows []row
			var moved int
			rows, moved, held, err = r.take(ctx)
			n, next, failures = len(rows)+moved, time.Time{}, 0
			if n > 0 || err != nil {
				// Not idle after all: publish without the lock, or
				// writers would notify while this relay is busy.
				release(false)
			}
			if len(rows) > 0 {
				next, failures, err = r.process(ctx, rows)
			}
			if ctx.Err() != nil {
				release(true)
				return nil
			}
			r.stats.endRound(failures, err)
			if err != nil {
				r.cfg.Logger.Error("outbox relay: batch failed, retrying after the poll interval", err, nil)
			}
			if !next.IsZero() && (due.IsZero() || next.Before(due)) {
				due = next
			}
			if n > 0 && err == nil {
				continue
			}
			if !settled {
				// A writer that may have missed the request is still
				// in its transaction: look again soon.
				wait = min(wait, idleRecheck)
			}
		}
		if held {
			heldWait = min(max(2*heldWait, idleRecheck), r.cfg.PollInterval, maxHeldWait)
			wait = min(wait, heldWait)
		} else {
			heldWait = 0
		}
		if !due.IsZero() {
			if d := time.Until(due); d < wait {
				wait = max(d, 0)
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			release(true)
			return nil
		case <-r.closing:
			t.Stop()
			release(true)
			return nil
		case <-wake:
		case <-t.C:
		}
		t.Stop()
		release(false)
		if !due.IsZero() && !time.Now().Before(due) {
			due = time.Time{}
		}
	}
}

// helpCooldown is how long a relay runs without a helper after its
// helper met other relays' batches (see help).
const helpCooldown = time.Second

// maxHeldWait bounds the wait of a relay whose claims find only rows other
// relays are publishing in the database: they are released when the
// holder commits, within a batch's time.
const maxHeldWait = 40 * time.Millisecond

// idleRecheck is how soon an idle relay looks again when a writer that may
// have missed its request for a notification is still in its transaction.
const idleRecheck = 5 * time.Millisecond

// wakeLockClass is the first half of the wake-up lock's key ("mwox" in
// ASCII); the second is the outbox table's oid. See
// migrations/002_outbox_wakeup_lock.sql.
const wakeLockClass = 1836543864

// announceIdle asks writers for a NOTIFY by taking the wake-up lock on the
// relay's own connection, without waiting. While a relay holds it, every
// writing transaction notifies at commit. It reports settled when no
// writer that committed unannounced can be in flight: true once the lock
// is held (every writer that took it shared has ended, so a look at the
// table now sees its rows) or when another relay holds it (writers notify
// it, and every relay LISTENs); false while writers hold it shared, so the
// relay must look again soon.
//
// release gives the lock back; call it as soon as the relay has work, and
// when it wakes. With handOver (the relay is stopping) it also notifies,
// so that relays sleeping on this one's lock wake and one of them takes it
// over; without it they would sleep until their poll. release is
// idempotent.
func (r *Relay) announceIdle(ctx context.Context) (release func(handOver bool), settled bool, err error) {
	release = func(bool) {}
	var state string
	if err := r.waitDB.QueryRowContext(ctx, r.tryLockSQL).Scan(&state); err != nil {
		return release, false, fmt.Errorf("taking the outbox wake-up lock: %w", err)
	}
	switch state {
	case "held":
		done := false
		return func(handOver bool) {
			if done {
				return
			}
			done = true
			q := r.unlockSQL
			if handOver {
				q = r.handOverSQL
			}
			// A failed unlock leaves the lock to the session's end:
			// writers notify a little longer, nothing is lost. Bounded,
			// so an unreachable server cannot stall the relay here.
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if _, err := r.waitDB.ExecContext(uctx, q); err != nil {
				r.cfg.Logger.Info("outbox relay: releasing the wake-up lock failed; the connection's end releases it", watermill.LogFields{"err": err.Error()})
			}
		}, true, nil
	case "other":
		return release, true, nil
	default:
		return release, false, nil
	}
}

// setWakeStatements builds the wake-up lock's statements, each without
// parameters (one round trip with lib/pq): the try, which reports 'held',
// 'other' (another relay holds it) or 'writers' (writers hold it shared);
// the unlock; and the unlock that also notifies (hand-over).
func (r *Relay) setWakeStatements() {
	key := fmt.Sprintf("%d, %d", wakeLockClass, int32(r.tableOID))
	held, unlock := `'held'`, `SELECT pg_advisory_unlock(`+key+`)`
	if r.holdGuard {
		// A holder that stops answering (a hung process, a half-open
		// connection) would otherwise keep every writer notifying, and
		// commits serialised, until TCP gives up on it: the server ends a
		// holding session idle for longer than the relay ever is while
		// alive (it unlocks and takes the lock again every PollInterval).
		held = `CASE WHEN set_config('idle_session_timeout', '` + strconv.FormatInt(r.holdTimeout().Milliseconds(), 10) + `', false) IS NOT NULL THEN 'held' END`
		unlock += `, set_config('idle_session_timeout', '0', false)`
	}
	r.tryLockSQL = `SELECT CASE
		WHEN pg_try_advisory_lock(` + key + `) THEN ` + held + `
		WHEN EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid = ` + strconv.Itoa(wakeLockClass) + ` AND objid = '` + strconv.FormatUint(uint64(r.tableOID), 10) + `'::oid AND objsubid = 2)
		THEN 'other' ELSE 'writers' END`
	r.unlockSQL = unlock
	r.handOverSQL = unlock + `, pg_notify(` + pq.QuoteLiteral(NotifyChannel(r.schema)) + `, '')`
}

// holdTimeout is the idle_session_timeout of a session holding the wake-up
// lock: well beyond the longest a live relay leaves it idle (PollInterval).
func (r *Relay) holdTimeout() time.Duration { return 3*r.cfg.PollInterval + 2*time.Second }

// Close stops Run after the batch in flight, waiting at most CloseTimeout
// before cancelling it. It is idempotent and safe to call before Run.
func (r *Relay) Close() error {
	r.closeOnce.Do(func() { close(r.closing) })
	if !r.started.Load() {
		return nil
	}
	t := time.NewTimer(r.cfg.CloseTimeout)
	defer t.Stop()
	select {
	case <-r.done:
	case <-t.C:
		r.mu.Lock()
		if r.cancel != nil {
			r.cancel()
		}
		r.mu.Unlock()
		<-r.done
	}
	return nil
}

// listen starts a LISTEN on the outbox's notification channel and forwards
// notifications (and reconnections, after which some may have been missed)
// to wake. It also opens the connection on which the idle relay holds the
// wake-up lock (announceIdle): both are on ListenURL, outside the caller's
// pool, so a small pool cannot starve them.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) (stop func(), err error) {
	const q = `SELECT n.nspname, c.oid::int8, current_database(), current_setting('server_version_num')::int
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'millwright_outbox'::regclass`
	var schema, dbName string
	var oid int64
	var version int
	if err := r.db.QueryRowContext(ctx, q).Scan(&schema, &oid, &dbName, &version); err != nil {
		return nil, fmt.Errorf("finding the schema of millwright_outbox (did `millwright migrate` run?): %w", err)
	}
	// Bounded connections (see internal/pgconn): connect_timeout unless
	// ListenURL sets one, and each call gives up when its ctx ends, even on
	// a server that accepts and never answers.
	waitDB, err := pgconn.Open(r.cfg.ListenURL)
	if err != nil {
		return nil, fmt.Errorf("RelayConfig.ListenURL: %w", err)
	}
	waitDB.SetMaxOpenConns(1)
	waitDB.SetMaxIdleConns(1)
	var lSchema, lDB string
	var lOID int64
	if err := waitDB.QueryRowContext(ctx, q).Scan(&lSchema, &lOID, &lDB, &version); err != nil {
		waitDB.Close()
		return nil, fmt.Errorf("RelayConfig.ListenURL does not reach millwright_outbox (it must reach the relay's database and search_path): %w", err)
	}
	if lOID != oid {
		waitDB.Close()
		return nil, fmt.Errorf("RelayConfig.ListenURL reaches millwright_outbox in %s.%s, the relay's *sql.DB the one in %s.%s: point both at the same database and search_path", lDB, lSchema, dbName, schema)
	}
	l := pgconn.NewListener(ctx, r.cfg.ListenURL, 100*time.Millisecond, 10*time.Second, func(ev pq.ListenerEventType, err error) {
		if err != nil {
			r.cfg.Logger.Info("outbox relay: listener event", watermill.LogFields{"event": ev, "err": err.Error()})
		}
	})
	// Listen waits for a connection as long as it takes: stop it with ctx.
	listened := make(chan error, 1)
	go func() { listened <- l.Listen(NotifyChannel(schema)) }()
	var lerr error
	select {
	case lerr = <-listened:
	case <-ctx.Done():
		l.Close()
		<-listened
		lerr = context.Cause(ctx)
	}
	if lerr != nil {
		l.Close()
		waitDB.Close()
		return nil, fmt.Errorf("LISTEN %q: %w", NotifyChannel(schema), lerr)
	}
	r.schema, r.tableOID, r.waitDB, r.holdGuard = schema, uint32(oid), waitDB, version >= 140000
	r.setWakeStatements()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case _, ok := <-l.NotificationChannel():
				if !ok {
					return
				}
				select {
				case wake <- struct{}{}:
				default:
				}
			}
		}
	}()
	return func() {
		l.Close()
		<-done
		waitDB.Close()
	}, nil
}

// NotifyChannel is the LISTEN channel of the outbox table in schema.
func NotifyChannel(schema string) string { return "millwright_outbox:" + schema }

func (r *Relay) refreshLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.MetricsInterval)
	defer t.Stop()
	for {
		if err := r.m.refreshGauges(ctx, r.db); err != nil && ctx.Err() == nil {
			r.cfg.Logger.Error("outbox relay: refreshing backlog gauges", err, nil)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// row is one claimed outbox row.
type row struct {
	id         int64
	topic      string
	aggType    string
	aggID      string
	aggKey     string
	retryCount int
	createdAt  time.Time
	msg        *message.Message
}

// claimSQL claims at most $1 rows, leasing them for $3 milliseconds, in one
// autocommitted statement, so no transaction stays open while publishing.
//
// heads are the oldest pending row of each aggregate whose time has come,
// locked with SKIP LOCKED so concurrent relays take disjoint aggregates. A
// row is a head only if no older row of its aggregate is pending; a leased
// or backing-off head therefore holds back its whole aggregate and nothing
// else. Each head brings its aggregate's next pending rows (an equal share
// of the batch): no other relay can claim them while their head is pending.
//
// Heads are looked for among the first $2 due rows in id order only (the
// window, windowFactor x BatchSize), so a claim costs at most $2 index
// probes however large the backlog, where walking until $1 heads are found
// would read the whole backlog whenever it holds fewer aggregates than that
// (the forwarder's cost). Rows that cannot be heads stay out of the window:
// followers of a claimed head are leased with it and those of a failing
// head are parked until its next attempt (see fail). Only a backlog of more
// than $2 due rows of aggregates already claimed by other relays keeps a
// relay from seeing heads behind them, until the backlog shrinks.
//
// The window is walked lazily: the walk stops as soon as $1 heads are
// locked. Each head is locked as the walk reaches it (FOR UPDATE SKIP
// LOCKED in a lateral subquery, under the LIMIT), so a relay skips the
// heads another relay is claiming and walks on to the next ones instead
// of coming back with fewer. Each locked head then brings up to
// share-1 followers (share = $1 / locked heads); with as many heads as the
// batch holds, LIMIT 0 skips the follower probes altogether (a 500-head
// claim: 17-19 ms -> 13-15 ms under EXPLAIN ANALYZE). "id <= min()" is the same test as
// "id = min()" (the row itself is pending) but keeps the planner's
// estimate sane, and ids are passed as arrays, so every step is an index
// probe.
const claimSQL = claimCTE + `
UPDATE millwright_outbox t
SET next_attempt_at = now() + $3 * interval '1 millisecond'
WHERE t.id = ANY(ARRAY(SELECT id FROM claimed)) AND t.status = 'pending'
RETURNING t.id, t.event_id, t.topic, t.aggregate_type, t.aggregate_id, t.event_type,
	t.payload::text, t.payload_raw, t.metadata::text, t.retry_count, t.created_at`

// isHead is true for the window row c that is its aggregate's oldest
// pending row, the only one a claim may take (see claimSQL).
const isHead = `c.id <= (
		SELECT min(p.id) FROM millwright_outbox p
		WHERE p.status = 'pending' AND p.aggregate_type = c.aggregate_type
		  AND p.aggregate_id = c.aggregate_id)`

// claimCTE finds the rows a claim takes ($1: batch size, $2: window) as
// CTE claimed; see claimSQL.
const claimCTE = `WITH locked AS (
	SELECT l.id, l.aggregate_type, l.aggregate_id
	FROM (
		SELECT o.id, o.aggregate_type, o.aggregate_id
		FROM millwright_outbox o
		WHERE o.status = 'pending' AND o.next_attempt_at <= now()
		ORDER BY o.id
		LIMIT $2
	) c
	CROSS JOIN LATERAL (
		SELECT o.id, o.aggregate_type, o.aggregate_id
		FROM millwright_outbox o
		WHERE o.id = c.id AND o.status = 'pending' AND o.next_attempt_at <= now()
		FOR UPDATE OF o SKIP LOCKED
	) l
	WHERE ` + isHead + `
	LIMIT $1
), claimed AS (
	SELECT id FROM locked
	UNION ALL
	SELECT f.id FROM locked h CROSS JOIN LATERAL (
		SELECT p.id FROM millwright_outbox p
		WHERE p.status = 'pending' AND p.aggregate_type = h.aggregate_type
		  AND p.aggregate_id = h.aggregate_id AND p.id > h.id
		ORDER BY p.id
		LIMIT GREATEST(1, $1 / (SELECT count(*) FROM locked)) - 1
	) f
)`

// windowFactor sizes the claim's window: windowFactor x BatchSize due rows.
const windowFactor = 4

// claimStmt prepares the claim once per relay (database/sql prepares it
// again on each pooled connection): a prepared statement runs in one round
// trip and, after a few executions, skips planning, which costs more than
// executing the claim.
func (r *Relay) claimStmt(ctx context.Context) (*sql.Stmt, error) {
	return r.prepare(ctx, &r.stmt, claimSQL)
}

// prepare prepares query into *stmt once.
func (r *Relay) prepare(ctx context.Context, stmt **sql.Stmt, query string) (*sql.Stmt, error) {
	r.stmtMu.Lock()
	defer r.stmtMu.Unlock()
	if *stmt != nil {
		return *stmt, nil
	}
	s, err := r.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, fmt.Errorf("outbox relay: preparing the claim (did `millwright migrate` run?): %w", err)
	}
	*stmt = s
	return s, nil
}

func (r *Relay) claim(ctx context.Context) ([]row, error) {
	stmt, err := r.claimStmt(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := stmt.QueryContext(ctx, r.cfg.BatchSize, windowFactor*r.cfg.BatchSize, r.cfg.Lease.Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	defer rows.Close()
	var out []row
	for rows.Next() {
		var (
			rw row
			sr storedRow
		)
		if err := rows.Scan(&rw.id, &sr.eventID, &rw.topic, &sr.aggType, &sr.aggID, &sr.eventType, &sr.payload, &sr.raw, &sr.metadata, &rw.retryCount, &sr.createdAt); err != nil {
			return nil, fmt.Errorf("outbox relay: reading claimed row: %w", err)
		}
		rw.createdAt = sr.createdAt
		msg, err := rowMessage(sr)
		if err != nil {
			// Unreachable through Add; a hand-written row. Publish it with
			// the metadata its columns give rather than drop the event.
			r.cfg.Logger.Error("outbox relay: row metadata is not a string map; published with the metadata its columns give", err, watermill.LogFields{"id": rw.id, "topic": rw.topic, "message_uuid": sr.eventID})
		}
		msg.SetContext(ctx)
		rw.aggType, rw.aggID = sr.aggType, sr.aggID
		rw.aggKey = sr.aggType + "\x00" + sr.aggID
		rw.msg = msg
		out = append(out, rw)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out, nil
}

// storedRow is an outbox row as read back for publishing.
type storedRow struct {
	eventID, aggType, aggID, eventType string
	payload                            sql.NullString
	raw                                []byte
	metadata                           string // JSON
	createdAt                          time.Time
}

// rowMessage builds the message of a claimed row: the metadata the row's
// columns give (derivedMetadata), overridden by the metadata column. The
// event_id column is authoritative for the message UUID and
// metadata.EventID. A metadata column that is not a JSON object of strings
// (only a hand-written row can have one) is ignored and reported for the
// log; the event is still published.
func rowMessage(r storedRow) (*message.Message, error) {
	body := r.raw
	if r.payload.Valid {
		body = []byte(r.payload.String)
	}
	msg := message.NewMessage(r.eventID, body)
	var stored map[string]string
	err := json.Unmarshal([]byte(r.metadata), &stored)
	if err != nil {
		stored = nil
	}
	msg.Metadata = make(message.Metadata, len(stored)+10)
	derivedMetadata(r.eventID, r.aggType, r.aggID, r.eventType, r.payload.Valid, r.createdAt, msg.Metadata.Set)
	for k, v := range stored {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.EventID, r.eventID)
	if r.aggID != "" && msg.Metadata.Get(metadata.OrderingKey) == "" {
		// An empty ordering key in the metadata column (set so by the
		// writer, or by hand) would send the aggregate unkeyed: it may
		// replace the aggregate's key, not remove it.
		msg.Metadata.Set(metadata.OrderingKey, orderingKey(r.aggType, r.aggID))
	}
	return msg, err
}

// RunOnce claims, publishes and marks one batch and returns the number of
// rows it claimed (0: nothing was due). It is for tools, benchmarks and
// tests that drive a relay step by step; a service calls Run. RunOnce is
// safe to call concurrently with itself and with Run.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	n, _, err := r.runOnce(ctx)
	return n, err
}

// runOnce claims, publishes and marks one batch. It returns the number of
// rows claimed and the earliest backoff it scheduled.
func (r *Relay) runOnce(ctx context.Context) (int, time.Time, error) {
	rows, moved, _, err := r.take(ctx)
	if err != nil || len(rows) == 0 {
		r.stats.endRound(0, err)
		return moved, time.Time{}, err
	}
	next, failures, err := r.process(ctx, rows)
	r.stats.endRound(failures, err)
	return len(rows) + moved, next, err
}

// claimed is the result of a claim made ahead of time.
type claimed struct {
	rows []row
	err  error
}

// prefetch claims the next batch while the current one is being
// published. This is safe for ordering: while the current batch is leased
// and unmarked, its aggregates' heads are pending, so the next claim can
// take none of their rows.
func (r *Relay) prefetch(ctx context.Context) <-chan claimed {
	ch := make(chan claimed, 1)
	go func() {
		rows, err := r.claim(ctx)
		ch <- claimed{rows, err}
	}()
	return ch
}

// process publishes claimed rows and marks them. It returns the earliest
// backoff it scheduled and the number of rows whose publish failed.
func (r *Relay) process(ctx context.Context, rows []row) (time.Time, int, error) {
	results := r.publish(rows)
	// Within an aggregate, nothing after a failure counts as published: it
	// is released and republished after the failed row (at-least-once,
	// never out of order for a consumer that drops duplicates).
	blocked := map[string]bool{}
	var published, held []int64
	var failedIdx []int
	for i, rw := range rows {
		switch {
		case blocked[rw.aggKey]:
			held = append(held, rw.id)
		case results[i] == nil:
			published = append(published, rw.id)
		default:
			blocked[rw.aggKey] = true
			failedIdx = append(failedIdx, i)
		}
	}
	if r.afterPublish != nil {
		r.afterPublish(ctx, published)
	}
	var errs []error
	if len(published) > 0 {
		if _, err := r.db.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE id = ANY(`+idArray(published)+`) AND status = 'pending'`); err != nil {
			errs = append(errs, fmt.Errorf("outbox relay: marking %d row(s) published (they will be republished after the lease): %w", len(published), err))
		} else {
			r.m.published.Add(float64(len(published)))
			r.stats.published.Add(uint64(len(published)))
		}
	}
	if len(held) > 0 {
		if _, err := r.db.ExecContext(ctx, `UPDATE millwright_outbox SET next_attempt_at = now() WHERE id = ANY(`+idArray(held)+`) AND status = 'pending'`); err != nil {
			errs = append(errs, fmt.Errorf("outbox relay: releasing %d row(s): %w", len(held), err))
		}
	}
	var next time.Time
	if len(failedIdx) > 0 {
		n, err := r.fail(ctx, rows, results, failedIdx)
		next = n
		errs = append(errs, err)
	}
	return next, len(failedIdx), errors.Join(errs...)
}

// idArray renders ids as a bigint[] literal, so that hot statements carry
// no parameters (one round trip with lib/pq instead of two).
func idArray(ids []int64) string {
	var b strings.Builder
	b.WriteString("'{")
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	b.WriteString("}'::bigint[]")
	return b.String()
}

// publish sends the rows and returns one error per row (nil: accepted).
func (r *Relay) publish(rows []row) []error {
	results := make([]error, len(rows))
	if r.batch != nil {
		byTopic := map[string][]int{}
		var topics []string
		for i, rw := range rows {
			if _, ok := byTopic[rw.topic]; !ok {
				topics = append(topics, rw.topic)
			}
			byTopic[rw.topic] = append(byTopic[rw.topic], i)
		}
		for _, topic := range topics {
			idx := byTopic[topic]
			msgs := make([]*message.Message, len(idx))
			for j, i := range idx {
				msgs[j] = rows[i].msg
			}
			start := time.Now()
			end := tracing.RelayPublish(topic, msgs...)
			err := r.batch.PublishBatch(topic, msgs...)
			end(err)
			r.m.latency.Observe(time.Since(start).Seconds())
			if err == nil {
				continue
			}
			var be *batch.Error
			if errors.As(err, &be) {
				for j, e := range be.Failed {
					if j >= 0 && j < len(idx) {
						results[idx[j]] = e
					}
				}
				continue
			}
			for _, i := range idx {
				results[i] = err
			}
		}
		return results
	}

	// Aggregates are spread over PublishConcurrency workers; each worker
	// sends its share with one Publish call per topic (in id order, so each
	// aggregate stays in order): a transport whose Publish takes many
	// messages at once (watermill-sql inserts them in one statement) gets
	// them at once. If a call fails, all its messages count as failed: some
	// may have gone out and will go again (at-least-once).
	workers := min(r.cfg.PublishConcurrency, len(rows))
	share := make([][]int, workers)
	slot := map[string]int{}
	for i, rw := range rows {
		w, ok := slot[rw.aggKey]
		if !ok {
			w = len(slot) % workers
			slot[rw.aggKey] = w
		}
		share[w] = append(share[w], i)
	}
	var wg sync.WaitGroup
	for _, idx := range share {
		if len(idx) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var topics []string
			byTopic := map[string][]int{}
			for _, i := range idx {
				if _, ok := byTopic[rows[i].topic]; !ok {
					topics = append(topics, rows[i].topic)
				}
				byTopic[rows[i].topic] = append(byTopic[rows[i].topic], i)
			}
			for _, topic := range topics {
				ti := byTopic[topic]
				msgs := make([]*message.Message, len(ti))
				for j, i := range ti {
					msgs[j] = rows[i].msg
				}
				start := time.Now()
				end := tracing.RelayPublish(topic, msgs...)
				err := r.pub.Publish(topic, msgs...)
				end(err)
				r.m.latency.Observe(time.Since(start).Seconds())
				if err != nil {
					for _, i := range ti {
						results[i] = err
					}
				}
			}
		}()
	}
	wg.Wait()
	return results
}

// fail records failed attempts: a backoff, or the failed state once the
// retry policy is exhausted (with a copy to the dead-letter topic).
func (r *Relay) fail(ctx context.Context, rows []row, results []error, idx []int) (time.Time, error) {
	ids := make([]int64, len(idx))
	delays := make([]int64, len(idx))
	msgs := make([]string, len(idx))
	final := make([]bool, len(idx))
	var next time.Time
	now := time.Now()
	for k, i := range idx {
		rw := rows[i]
		attempt := rw.retryCount + 1
		ids[k] = rw.id
		msgs[k] = results[i].Error()
		r.m.publishErrors.Inc()
		if r.cfg.Retry.Exhausted(attempt, now.Sub(rw.createdAt)) {
			final[k] = true
			r.deadLetter(rw, results[i])
			r.cfg.Logger.Error("outbox relay: event failed for good", results[i], tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "attempts": attempt}))
			continue
		}
		d := r.cfg.Retry.Delay(attempt, 0)
		delays[k] = d.Milliseconds()
		r.stats.retried.Add(1)
		if due := now.Add(d); next.IsZero() || due.Before(next) {
			next = due
		}
	}
	res, err := r.db.ExecContext(ctx, `UPDATE millwright_outbox t SET
		retry_count = t.retry_count + 1,
		last_error = u.err,
		status = CASE WHEN u.final THEN 'failed' ELSE 'pending' END,
		next_attempt_at = now() + u.delay_ms * interval '1 millisecond'
	FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bool[]) AS u(id, delay_ms, err, final)
	WHERE t.id = u.id AND t.status = 'pending'`,
		pq.Array(ids), pq.Array(delays), pq.Array(msgs), pq.Array(final))
	if err != nil {
		return next, fmt.Errorf("outbox relay: recording %d failed publish(es): %w", len(ids), err)
	}
	// Park the followers of each row that will be retried until its next
	// attempt, so they stay out of every relay's claim window.
	var pTypes, pIDs []string
	var pHeads, pDelays []int64
	for k, i := range idx {
		if !final[k] {
			pTypes, pIDs = append(pTypes, rows[i].aggType), append(pIDs, rows[i].aggID)
			pHeads, pDelays = append(pHeads, rows[i].id), append(pDelays, delays[k])
		}
	}
	if len(pHeads) > 0 {
		if _, err := r.db.ExecContext(ctx, `UPDATE millwright_outbox t SET next_attempt_at = now() + u.delay_ms * interval '1 millisecond'
			FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS u(atype, aid, head, delay_ms)
			WHERE t.status = 'pending' AND t.aggregate_type = u.atype AND t.aggregate_id = u.aid AND t.id > u.head`,
			pq.Array(pTypes), pq.Array(pIDs), pq.Array(pHeads), pq.Array(pDelays)); err != nil {
			return next, fmt.Errorf("outbox relay: parking the followers of %d failing event(s): %w", len(pHeads), err)
		}
	}
	if _, err := res.RowsAffected(); err == nil {
		for _, f := range final {
			if f {
				r.m.failed.Inc()
				r.stats.failed.Add(1)
			}
		}
	}
	return next, nil
}

// deadLetter sends a copy of a failed event to the dead-letter topic, if one
// is configured. The row is marked failed whatever happens here, so the
// event stays in the outbox for the operator.
func (r *Relay) deadLetter(rw row, cause error) {
	if r.cfg.DeadLetterTopic == "" {
		return
	}
	m := rw.msg.Copy()
	m.Metadata.Set(MetadataDeadLetterError, cause.Error())
	m.Metadata.Set(MetadataDeadLetterTopic, rw.topic)
	m.SetContext(rw.msg.Context())
	if err := r.pub.Publish(r.cfg.DeadLetterTopic, m); err != nil {
		r.cfg.Logger.Error("outbox relay: publishing to the dead-letter topic failed; the row stays failed in the outbox", err,
			tracing.LogFields(rw.topic, rw.msg).Add(watermill.LogFields{"id": rw.id, "dead_letter_topic": r.cfg.DeadLetterTopic}))
		return
	}
	r.stats.deadLettered.Add(1)
}
