package sql

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/internal/storage"
)

// Horizon is the Postgres xmin horizon at one moment: the oldest
// transaction still running anywhere on the server (in any database) that
// has a transaction id, i.e. has written. watermill-sql's subscribers read
// only rows whose transaction_id is below it
// (transaction_id < pg_snapshot_xmin(pg_current_snapshot())), so that a
// slow writer's rows are never skipped; the price is that while one
// transaction stays open, no consumer group of any topic on the server
// receives a message committed after it took its id.
type Horizon struct {
	// Held is false when no transaction with an id is running: nothing
	// holds consumers back.
	Held bool
	// XID is the horizon itself (pg_snapshot_xmin of the current
	// snapshot): the holder's transaction id when Held.
	XID uint64
	// Found is false when Held but no session or prepared transaction
	// has that id: it ended between the two reads. The fields below are
	// then zero.
	Found bool
	// Hidden is true when the holder is another role's session and this
	// role lacks pg_read_all_stats: its pid, database and user are known
	// but State and Application are empty and Age is 0.
	Hidden bool
	// PID is the holder's backend pid; 0 for a prepared transaction.
	PID int
	// Database, User, Application and State are the holder's, from
	// pg_stat_activity ("idle in transaction" for a forgotten session;
	// "prepared" for a prepared transaction, whose User is its owner).
	Database, User, Application, State string
	// Prepared is true for a prepared transaction (PREPARE TRANSACTION),
	// which holds the horizon until COMMIT PREPARED or ROLLBACK PREPARED
	// GID, even across restarts.
	Prepared bool
	GID      string
	// Age is how long the holder's transaction has been open (since its
	// xact_start, or since it was prepared).
	Age time.Duration
}

// Queryer is what ReadHorizon reads through: a *sql.DB, *sql.Conn or
// *sql.Tx, a pgx.Tx, *pgx.Conn or *pgxpool.Pool (anything the storage
// layer's storage.From accepts).
type Queryer = any

// ReadHorizon reads the server's xmin horizon and the transaction holding
// it. To see the state and age of other roles' sessions, the role needs
// pg_read_all_stats (or to be a superuser); otherwise Hidden is true.
func ReadHorizon(ctx context.Context, db Queryer) (Horizon, error) {
	q, err := storage.From(db)
	if err != nil {
		return Horizon{}, fmt.Errorf("sql: reading the xmin horizon: %w", err)
	}
	x, err := storage.ReadXminHorizon(ctx, q)
	if err != nil {
		return Horizon{}, fmt.Errorf("sql: reading the xmin horizon (pg_current_snapshot, pg_stat_activity): %w", err)
	}
	h := Horizon{Held: x.Held, Found: x.Found, Hidden: x.Hidden, PID: x.PID, Database: x.Database, User: x.User,
		Application: x.Application, State: x.State, Prepared: x.Prepared, GID: x.GID}
	if h.XID, err = strconv.ParseUint(x.XID, 10, 64); err != nil {
		return Horizon{}, fmt.Errorf("sql: reading the xmin horizon: %q is not a transaction id", x.XID)
	}
	h.Age = time.Duration(max(x.AgeSeconds, 0) * float64(time.Second))
	return h, nil
}

// maxCountedRows caps the count of waiting rows per topic, so that a check
// stays cheap however long consumers have been blocked.
const maxCountedRows = 10000

// waitingRows counts (up to maxCountedRows) the committed rows of topic
// that no consumer group can read yet: those at or above the horizon.
// The primary key starts with transaction_id, so this reads only them.
func waitingRows(ctx context.Context, db *stdsql.DB, topic string) (int64, error) {
	n, err := storage.CountBehindHorizon(ctx, storage.NewSQL(db), schema.MessagesTable(topic), maxCountedRows)
	if err != nil {
		return 0, fmt.Errorf("sql: counting the rows of topic %q behind the xmin horizon: %w", topic, err)
	}
	return n, nil
}

// RunbookHorizon is the runbook section for consumers blocked by the
// horizon; the log and the alert point at it.
const RunbookHorizon = "docs/runbooks.md#millwrightsqlhorizonheld"

const (
	// horizonCheckTimeout bounds one check (the horizon and every topic's
	// count), so that a server that stops answering cannot hang the
	// monitor or Close.
	horizonCheckTimeout = 5 * time.Second
	// horizonRepeat is how often a warning about the same holder repeats
	// while consumers stay blocked.
	horizonRepeat = time.Minute
)

// horizonMonitor watches the horizon for one Transport while it has
// subscriptions: it sets the gauges and logs, at most once a minute per
// holder, the topics whose committed rows wait behind a holder older than
// warnAge, and when they no longer do.
type horizonMonitor struct {
	db       *stdsql.DB
	logger   watermill.LoggerAdapter
	interval time.Duration
	warnAge  time.Duration
	m        *metrics

	mu      sync.Mutex
	topics  map[string]int // subscribed topic -> live subscriptions
	started bool
	stopped bool
	cancel  context.CancelFunc
	done    chan struct{}

	// Owned by the run goroutine.
	seenXID    uint64    // the horizon of the last check
	seenAt     time.Time // when it was first seen
	blocked    bool      // a warning is out and not yet cleared
	warnedXID  uint64
	warnedAt   time.Time
	blockedAt  time.Time
	warnedWho  string
	checkError bool

	// checks counts finished checks, for tests to wait on.
	checks atomic.Int64
}

func newHorizonMonitor(db *stdsql.DB, logger watermill.LoggerAdapter, interval, warnAge time.Duration, m *metrics) *horizonMonitor {
	return &horizonMonitor{db: db, logger: logger, interval: interval, warnAge: warnAge, m: m,
		topics: map[string]int{}, done: make(chan struct{})}
}

// watch adds a subscription to topic, starting the monitor with the first
// one; the returned func removes it.
func (h *horizonMonitor) watch(topic string) (unwatch func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return func() {}
	}
	h.topics[topic]++
	if !h.started {
		h.started = true
		ctx, cancel := context.WithCancel(context.Background())
		h.cancel = cancel
		go h.run(ctx)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.topics[topic]--; h.topics[topic] <= 0 {
				delete(h.topics, topic)
			}
		})
	}
}

func (h *horizonMonitor) watched() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.topics))
	for t := range h.topics {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// stop ends the monitor: it cancels the check in flight and waits for it
// at most a second (a pool of plain lib/pq may wait on a silent server
// despite the cancel; the check then ends by itself within
// horizonCheckTimeout, without logging). It is idempotent.
func (h *horizonMonitor) stop() {
	h.mu.Lock()
	if h.stopped {
		h.mu.Unlock()
		return
	}
	h.stopped = true
	started := h.started
	h.mu.Unlock()
	if !started {
		return
	}
	h.cancel()
	select {
	case <-h.done:
	case <-time.After(time.Second):
	}
	// A closed transport no longer watches: leave no stale age behind for
	// the alert.
	h.m.horizonAge.Set(0)
	h.m.horizonPID.Set(0)
}

func (h *horizonMonitor) run(ctx context.Context) {
	defer close(h.done)
	t := time.NewTicker(h.interval)
	defer t.Stop()
	for {
		h.check(ctx)
		h.checks.Add(1)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check reads the horizon, sets the gauges and, when the holder is older
// than warnAge, counts the watched topics' waiting rows.
func (h *horizonMonitor) check(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, horizonCheckTimeout)
	defer cancel()
	hz, err := ReadHorizon(ctx, h.db)
	if err != nil {
		h.failed(ctx, err)
		return
	}
	now := time.Now()
	age := hz.Age
	switch {
	case !hz.Held:
		h.seenXID, h.seenAt, age = 0, time.Time{}, 0
	case hz.XID != h.seenXID:
		h.seenXID, h.seenAt = hz.XID, now
	}
	if hz.Held && (!hz.Found || hz.Hidden) {
		// Ids are never reused: the same horizon means the same holder,
		// open at least since we first saw it.
		age = now.Sub(h.seenAt)
	}
	h.m.horizonAge.Set(age.Seconds())
	h.m.horizonPID.Set(float64(hz.PID))

	waiting := map[string]int64{}
	if hz.Held && age >= h.warnAge {
		for _, topic := range h.watched() {
			n, err := waitingRows(ctx, h.db, topic)
			if err != nil {
				h.failed(ctx, err)
				return
			}
			if n > 0 {
				waiting[topic] = n
			}
		}
	}
	if h.checkError {
		h.checkError = false
		h.logger.Info("sql: checking the xmin horizon works again", nil)
	}
	h.report(hz, age, waiting, now)
}

// failed logs the first failure of a streak; the next good check says so.
func (h *horizonMonitor) failed(ctx context.Context, err error) {
	if ctx.Err() != nil && errors.Is(context.Cause(ctx), context.Canceled) {
		return // stopping
	}
	if !h.checkError {
		h.checkError = true
		h.logger.Error("sql: checking the xmin horizon failed; retrying every interval (consumers blocked by a long transaction are not reported meanwhile)",
			err, watermill.LogFields{"interval": h.interval})
	}
}

// report logs blocked consumers: at once, again when the holder changes or
// a minute has passed, and once when they are no longer blocked.
func (h *horizonMonitor) report(hz Horizon, age time.Duration, waiting map[string]int64, now time.Time) {
	if len(waiting) == 0 {
		if h.blocked {
			h.blocked = false
			h.logger.Info("sql: consumers no longer blocked: the transaction holding the xmin horizon ended or committed rows no longer wait behind it",
				watermill.LogFields{"was_blocked_by": h.warnedWho, "blocked_for": now.Sub(h.blockedAt).Round(time.Millisecond)})
		}
		return
	}
	if h.blocked && hz.XID == h.warnedXID && now.Sub(h.warnedAt) < horizonRepeat {
		return
	}
	if !h.blocked {
		h.blockedAt = now
	}
	h.blocked, h.warnedXID, h.warnedAt = true, hz.XID, now
	h.warnedWho = holderName(hz)

	topics := make([]string, 0, len(waiting))
	var total int64
	for t, n := range waiting {
		total += n
		topics = append(topics, t)
	}
	sort.Strings(topics)
	parts := make([]string, len(topics))
	for i, t := range topics {
		parts[i] = fmt.Sprintf("%s: %s", t, countText(waiting[t]))
	}
	fields := watermill.LogFields{
		"topics":       strings.Join(parts, ", "),
		"waiting_rows": total,
		"horizon_xid":  hz.XID,
		"holder_age":   roundAge(age),
		"fix":          holderFix(hz),
		"runbook":      RunbookHorizon,
	}
	if hz.Found {
		fields["blocking_pid"] = hz.PID
		fields["blocking_database"] = hz.Database
		if !hz.Hidden {
			fields["blocking_state"] = hz.State
		}
		fields["blocking_user"] = hz.User
		if hz.Application != "" {
			fields["blocking_application"] = hz.Application
		}
		if hz.Prepared {
			fields["blocking_gid"] = hz.GID
		}
	}
	h.logger.Error("sql: consumers blocked by a long transaction holding the Postgres xmin horizon",
		&blockedError{h: hz, age: age, waiting: total, topics: strings.Join(parts, ", ")}, fields)
}

// blockedError is what the warning says, in one sentence: which rows
// wait, behind what, and the fix.
type blockedError struct {
	h       Horizon
	age     time.Duration
	waiting int64
	topics  string
}

func (e *blockedError) Error() string {
	return fmt.Sprintf("%s committed rows (%s) wait behind %s, the oldest transaction on the server: watermill-sql reads only rows below the xmin horizon it holds; %s (see %s)",
		countText(e.waiting), e.topics, describeHolder(e.h, e.age), holderFix(e.h), RunbookHorizon)
}

func countText(n int64) string {
	if n >= maxCountedRows {
		return "at least " + strconv.FormatInt(n, 10)
	}
	return strconv.FormatInt(n, 10)
}

func holderName(h Horizon) string {
	switch {
	case !h.Found:
		return "xid " + strconv.FormatUint(h.XID, 10)
	case h.Prepared:
		return fmt.Sprintf("prepared transaction %q", h.GID)
	}
	return "pid " + strconv.Itoa(h.PID)
}

func describeHolder(h Horizon, age time.Duration) string {
	switch {
	case !h.Found:
		return fmt.Sprintf("transaction %d (open at least %s), which ended while it was looked up or is not in pg_stat_activity", h.XID, roundAge(age))
	case h.Prepared:
		return fmt.Sprintf("prepared transaction %q (database %q, owner %q, prepared %s ago)", h.GID, h.Database, h.User, roundAge(age))
	}
	if h.Hidden {
		return fmt.Sprintf("the transaction of pid %d (database %q, user %q, open at least %s; its state is hidden from this role: grant it pg_read_all_stats)", h.PID, h.Database, h.User, roundAge(age))
	}
	return fmt.Sprintf("the transaction of pid %d (database %q, user %q, state %q, open %s)", h.PID, h.Database, h.User, h.State, roundAge(age))
}

func holderFix(h Horizon) string {
	switch {
	case !h.Found:
		return fmt.Sprintf("find it with SELECT pid, datname, state, xact_start FROM pg_stat_activity WHERE backend_xid = '%d'::xid8::xid (and pg_prepared_xacts), then end it with SELECT pg_terminate_backend(<pid>)", h.XID)
	case h.Prepared:
		return fmt.Sprintf("in database %q run ROLLBACK PREPARED '%s' (or COMMIT PREPARED) once you know what it was", h.Database, strings.ReplaceAll(h.GID, "'", "''"))
	}
	return fmt.Sprintf("end it with SELECT pg_terminate_backend(%d) and bound such sessions with idle_in_transaction_session_timeout", h.PID)
}

func roundAge(d time.Duration) time.Duration {
	if d >= 10*time.Second {
		return d.Round(time.Second)
	}
	return d.Round(time.Millisecond)
}
