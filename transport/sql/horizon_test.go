package sql_test

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport/sql"
)

// One session left idle in a transaction that has written, in another
// database of the server, stops the sql-transport consumer: the message
// published after it is not delivered while it stays open. The monitor
// reports it (gauge, pid gauge, an error log naming the pid and the fix);
// once the session commits, the message arrives and the log says the
// consumers are no longer blocked.
func TestLongTransactionBlockingConsumersIsReported(t *testing.T) {
	t.Parallel()
	b := setupHorizon(t)

	// Baseline: the consumer works.
	b.publish(t, "before")
	require.Equal(t, "before", b.receive(t, 60*time.Second))

	blocker := b.openBlocker(t)
	b.publish(t, "behind")

	// Reported while blocked, the message undelivered all along. Another
	// package's test (or another run's: the server is shared) may hold an
	// older transaction for a while: wait until ours is the holder. 60 s:
	// the transactions of the suite's sql tests end within
	// idle_in_transaction_session_timeout (60 s, transporttest's URL).
	var warning watermill.CapturedMessage
	require.Eventually(t, func() bool {
		var ok bool
		warning, ok = b.warningFor(blocker.pid)
		return ok
	}, 60*time.Second, 20*time.Millisecond, "no warning naming pid %d; logs:\n%s", blocker.pid, b.logs())
	b.requireNothingReceived(t)
	require.Greater(t, gauge(t, b.reg, sql.MetricHorizonAge), 0.2)
	require.Eventually(t, func() bool { return gauge(t, b.reg, sql.MetricHorizonPID) == float64(blocker.pid) },
		30*time.Second, 20*time.Millisecond)

	text := warning.Err.Error()
	t.Logf("warning: %s %v", text, warning.Fields)
	require.Contains(t, text, fmt.Sprintf("pid %d (database %q", blocker.pid, blocker.database), text)
	require.Contains(t, text, `state "idle in transaction"`, text)
	require.Contains(t, text, b.topic+": 1)", text)
	require.Contains(t, text, fmt.Sprintf("SELECT pg_terminate_backend(%d)", blocker.pid), text)
	require.Contains(t, text, "idle_in_transaction_session_timeout", text)
	require.Contains(t, text, sql.RunbookHorizon, text)
	require.Equal(t, blocker.pid, warning.Fields["blocking_pid"])
	require.Equal(t, int64(1), warning.Fields["waiting_rows"])

	// Still nothing after more checks, and the warning is not repeated
	// every check.
	after := sql.HorizonChecks(b.tr) + 3
	require.Eventually(t, func() bool { return sql.HorizonChecks(b.tr) >= after },
		10*time.Second, 10*time.Millisecond, "the monitor made no three more checks")
	b.requireNothingReceived(t)
	n := 0
	for _, w := range b.warnings() {
		if w.Fields["blocking_pid"] == blocker.pid {
			n++
		}
	}
	require.Equal(t, 1, n, b.logs())

	require.NoError(t, blocker.tx.Commit())
	require.Equal(t, "behind", b.receive(t, 60*time.Second))
	require.Eventually(t, func() bool { return b.cleared() }, 10*time.Second, 20*time.Millisecond, b.logs())
}

// A role without pg_read_all_stats sees another role's session's pid but
// not its state or age: the holder is still named, marked Hidden (the
// monitor then counts its age from when it first saw the horizon).
func TestReadHorizonOfAHiddenHolder(t *testing.T) {
	t.Parallel()
	admin := pgtest.New(t).DB
	role := fmt.Sprintf("mw_horizon_%d", time.Now().UnixNano())
	_, err := admin.Exec(`CREATE ROLE ` + role + ` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(`DROP ROLE ` + role) })
	u, err := url.Parse(pgtest.BaseURL())
	require.NoError(t, err)
	u.User = url.User(role)
	weak, err := stdsql.Open("postgres", u.String())
	require.NoError(t, err)
	defer weak.Close()
	if err := weak.Ping(); err != nil {
		t.Skipf("cannot connect as a new role (server's pg_hba): %v", err)
	}

	tx, err := admin.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // ends the blocker
	var (
		xid uint64
		pid int
	)
	require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id()::text::bigint, pg_backend_pid()`).Scan(&xid, &pid))

	// An older transaction elsewhere on the shared server (another test,
	// package or run) may hold the horizon for a while: 60 s, not 5.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		h, err := sql.ReadHorizon(ctx, weak)
		require.NoError(t, err)
		if h.XID == xid {
			require.True(t, h.Held, "%+v", h)
			require.True(t, h.Found, "%+v", h)
			require.True(t, h.Hidden, "%+v", h)
			require.Equal(t, pid, h.PID)
			require.Empty(t, h.State)
			require.Zero(t, h.Age)
			break
		}
		// An older transaction elsewhere: wait (bounded by ctx) for it to end.
		select {
		case <-ctx.Done():
			t.Fatalf("the horizon stayed at %d, not our transaction %d", h.XID, xid)
		case <-time.After(20 * time.Millisecond):
		}
	}

	// The admin role sees it.
	h, err := sql.ReadHorizon(ctx, admin)
	require.NoError(t, err)
	require.Equal(t, xid, h.XID)
	require.False(t, h.Hidden)
	require.Equal(t, "idle in transaction", h.State)
	require.Positive(t, h.Age)
}

func TestHorizonConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := sql.Open(context.Background(), sql.Config{URL: "postgres://h/db", HorizonCheckInterval: -2, HorizonWarnAge: -time.Second}, nil)
	require.ErrorContains(t, err, "HorizonCheckInterval -2ns is negative: want a duration, or -1 to disable the check")
	require.ErrorContains(t, err, "HorizonWarnAge -1s is negative")
	require.NoError(t, sql.Config{URL: "postgres://h/db", HorizonCheckInterval: -1}.Validate(), "-1 disables the check")
}

type horizonBundle struct {
	tr    *sql.Transport
	reg   *prometheus.Registry
	log   *captureLogger
	topic string
	msgs  <-chan *message.Message
}

func setupHorizon(t *testing.T) *horizonBundle {
	t.Helper()
	schema := pgtest.New(t)
	b := &horizonBundle{reg: prometheus.NewRegistry(), log: &captureLogger{}, topic: "horizon.orders"}
	tr, err := sql.Open(context.Background(), sql.Config{
		DB: schema.DB, PollInterval: 20 * time.Millisecond,
		HorizonCheckInterval: 100 * time.Millisecond, HorizonWarnAge: 200 * time.Millisecond,
		Registerer: b.reg,
	}, b.log)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tr.Close()) })
	b.tr = tr
	sub, err := tr.Subscriber("g")
	require.NoError(t, err)
	_, ok := sub.(message.SubscribeInitializer)
	require.True(t, ok, "the subscriber keeps SubscribeInitialize")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b.msgs, err = sub.Subscribe(ctx, b.topic)
	require.NoError(t, err)
	return b
}

func (b *horizonBundle) publish(t *testing.T, payload string) {
	t.Helper()
	require.NoError(t, b.tr.Publisher().Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte(payload))))
}

func (b *horizonBundle) receive(t *testing.T, limit time.Duration) string {
	t.Helper()
	select {
	case m := <-b.msgs:
		m.Ack()
		return string(m.Payload)
	case <-time.After(limit):
		t.Fatalf("no message within %s; logs:\n%s", limit, b.logs())
		return ""
	}
}

func (b *horizonBundle) requireNothingReceived(t *testing.T) {
	t.Helper()
	select {
	case m := <-b.msgs:
		t.Fatalf("received %q while a transaction held the horizon", m.Payload)
	default:
	}
}

type blocker struct {
	tx       *stdsql.Tx
	pid      int
	database string
}

// openBlocker leaves a session idle in a transaction that has an id, in
// another database of the server when it can (the "postgres" database).
func (b *horizonBundle) openBlocker(t *testing.T) blocker {
	t.Helper()
	u, err := url.Parse(pgtest.BaseURL())
	require.NoError(t, err)
	u.Path = "/postgres"
	db, err := stdsql.Open("postgres", u.String())
	require.NoError(t, err)
	if err := db.Ping(); err != nil {
		db.Close()
		t.Logf("database postgres unreachable (%v): blocking from the test database", err)
		db, err = stdsql.Open("postgres", pgtest.BaseURL())
		require.NoError(t, err)
	}
	t.Cleanup(func() { db.Close() })
	tx, err := db.Begin()
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() }) // never hold the server past the test
	bl := blocker{tx: tx}
	require.NoError(t, tx.QueryRow(`SELECT pg_backend_pid(), current_database(), txid_current()`).Scan(&bl.pid, &bl.database, new(int64)))
	return bl
}

func (b *horizonBundle) warnings() []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, m := range b.log.at(watermill.ErrorLogLevel) {
		if strings.HasPrefix(m.Msg, "sql: consumers blocked by a long transaction") {
			out = append(out, m)
		}
	}
	return out
}

func (b *horizonBundle) warningFor(pid int) (watermill.CapturedMessage, bool) {
	for _, m := range b.warnings() {
		if m.Fields["blocking_pid"] == pid {
			return m, true
		}
	}
	return watermill.CapturedMessage{}, false
}

func (b *horizonBundle) cleared() bool {
	for _, m := range b.log.at(watermill.InfoLogLevel) {
		if strings.HasPrefix(m.Msg, "sql: consumers no longer blocked") {
			return true
		}
	}
	return false
}

func (b *horizonBundle) logs() string {
	var s strings.Builder
	for _, lvl := range []watermill.LogLevel{watermill.ErrorLogLevel, watermill.InfoLogLevel} {
		for _, m := range b.log.at(lvl) {
			fmt.Fprintf(&s, "%d %s %v %v\n", lvl, m.Msg, m.Err, m.Fields)
		}
	}
	return s.String()
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// captureLogger keeps every log, safe to read while the monitor writes
// (watermill's CaptureLoggerAdapter hands out its live map).
type captureLogger struct {
	mu   sync.Mutex
	msgs []watermill.CapturedMessage
}

func (l *captureLogger) add(lvl watermill.LogLevel, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, watermill.CapturedMessage{Level: lvl, Msg: msg, Err: err, Fields: f.Copy(), Time: time.Now()})
}

func (l *captureLogger) at(lvl watermill.LogLevel) []watermill.CapturedMessage {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []watermill.CapturedMessage
	for _, m := range l.msgs {
		if m.Level == lvl {
			out = append(out, m)
		}
	}
	return out
}

func (l *captureLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add(watermill.ErrorLogLevel, msg, err, f)
}
func (l *captureLogger) Info(msg string, f watermill.LogFields) {
	l.add(watermill.InfoLogLevel, msg, nil, f)
}
func (l *captureLogger) Debug(msg string, f watermill.LogFields)          {}
func (l *captureLogger) Trace(msg string, f watermill.LogFields)          {}
func (l *captureLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
