package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// countingLogger records the lines logged at Info and Error (the levels an
// operator reads), to count them.
type countingLogger struct {
	mu    sync.Mutex
	lines []string
}

func (l *countingLogger) add(level, msg string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		msg += ": " + err.Error()
	}
	l.lines = append(l.lines, level+" "+msg)
}

func (l *countingLogger) Error(msg string, err error, _ watermill.LogFields) {
	l.add("ERROR", msg, err)
}
func (l *countingLogger) Info(msg string, _ watermill.LogFields)           { l.add("INFO", msg, nil) }
func (l *countingLogger) Debug(string, watermill.LogFields)                {}
func (l *countingLogger) Trace(string, watermill.LogFields)                {}
func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// since returns the lines logged after the first n.
func (l *countingLogger) since(n int) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines[n:]...)
}

func (l *countingLogger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.lines)
}

// pgProxy starts a faultproxy to the test server and returns it with
// rawURL (a postgres:// URL) through it.
func pgProxy(t *testing.T, rawURL string) (*faultproxy.Proxy, string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(u.Scheme, "postgres"), "the test needs a postgres:// URL, got a DSN")
	p, through, err := faultproxy.Through(rawURL, "5432")
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, through
}

// A database outage makes the relay back off: a bounded number of
// connection attempts and log lines over 5 s (before, a failed lane
// check returned "waiting" and the relay retried every 10 ms, logging
// each time), and the relay is publishing again soon after the database
// answers.
func TestRelay_DatabaseOutageIsBackedOffAndLoggedSparingly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "outage")
	p, through := pgProxy(t, b.schema.URL)
	db, err := pgconn.Open(through)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	log := &countingLogger{}
	startRelay(t, db, b.pubsub, Config{ListenURL: through, Logger: log})

	ctx := context.Background()
	// Written directly, not through the proxy: only the relay is cut off.
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "outage", AggregateID: "a", Payload: []byte(`{"n":1}`)}))
	eventually(t, 30*time.Second, func() bool { return len(got.all()) == 1 }, "the first event was not published before the outage")

	const outage = 5 * time.Second
	logged, cutBefore, refusedBefore := log.count(), p.CutConns(), p.Refused()
	end := time.Now().Add(outage)
	p.Outage(outage)
	<-time.After(time.Until(end)) // the fault's own length, not a synchronisation
	attempts := (p.Refused() - p.CutConns()) - (refusedBefore - cutBefore)
	lines := log.since(logged)
	failed := 0
	for _, l := range lines {
		if strings.Contains(l, "batch failed") {
			failed++
		}
	}
	t.Logf("during the %s outage: %d connection(s) refused, %d cut; %d line(s) logged:\n%s",
		outage, attempts, p.CutConns()-cutBefore, len(lines), strings.Join(lines, "\n"))
	require.Positive(t, attempts, "the relay never tried to reach the database during the outage: the fault did not happen")
	require.Positive(t, failed, "the relay logged no failed batch during the outage")
	// Backing off to at most a second with equal jitter, the relay's own
	// rounds are about a dozen (each up to three connection attempts, as
	// database/sql retries a bad connection), the LISTEN connection's
	// reconnections about six.
	require.LessOrEqual(t, attempts, int64(150), "too many connection attempts during a %s outage: the relay does not back off", outage)
	require.LessOrEqual(t, failed, 3, "the relay logged %d failed batches in a %s outage: want the first and at most one per %s", failed, outage, failureLogEvery)
	require.LessOrEqual(t, len(lines), 25, "too many lines logged during a %s outage", outage)

	// The database answers again: an event written now is published. How
	// soon is the backoff's cap (a second), which
	// TestFailures_LogOncePerIntervalWithTheCount checks on a fake clock
	// (every wait <= failureMax); here a 3 s wall-clock bound measured the
	// loaded machine, and could not tell the cap from no cap anyway (after
	// a 5 s outage an uncapped doubling waits about 5 s).
	written := time.Now()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "outage", AggregateID: "a", Payload: []byte(`{"n":2}`)}))
	// Looked for by its payload, not by a count: when the outage cut the
	// first event's mark, that event goes out again (at least once), so
	// the count can pass 2 without the new event.
	published := func() bool {
		for _, m := range got.all() {
			var p struct{ N int }
			if json.Unmarshal(m.Payload, &p) == nil && p.N == 2 {
				return true
			}
		}
		return false
	}
	eventually(t, 30*time.Second, published, "the event written after the outage was not published")
	t.Logf("the relay published the event written after the outage %s later", time.Since(written).Round(time.Millisecond))
	// The round that published it logs the recovery once it has marked it.
	recovered := func() bool {
		for _, l := range log.since(logged) {
			if strings.Contains(l, "working again after") {
				return true
			}
		}
		return false
	}
	eventually(t, 30*time.Second, recovered, "the relay did not log its recovery; lines:\n%s", strings.Join(log.since(logged), "\n"))
}

// Run on a schema without the outbox's tables fails at once, naming the
// missing table, the schema and the fix (before, it looped, logging the
// same error every round).
func TestRelay_RunWithoutMigrationsFailsAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t) // no migrations
	db, err := pgconn.Open(s.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	b := setup(t)
	r, err := New(postgres.From(db), b.pubsub, Config{})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case err = <-errc:
	case <-time.After(10 * time.Second):
		require.NoError(t, r.Close())
		t.Fatalf("Run on a schema without migrations was still running after 10s; it returned %v once closed", <-errc)
	}
	require.Error(t, err)
	for _, want := range []string{"millwright_outbox", "millwright migrate", s.Name, "search_path"} {
		require.ErrorContains(t, err, want, fmt.Sprintf("the error should name %q", want))
	}
	require.NoError(t, r.Close())
}

// A relay on a database migrated before migration 007 fails at start,
// naming the missing column and the fix, instead of failing every round
// on "column o.first_failed_at does not exist".
func TestRelay_RunWithoutTheNewestMigrationFailsAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	_, err := s.DB.Exec(`ALTER TABLE millwright_outbox DROP COLUMN first_failed_at`)
	require.NoError(t, err)
	b := setup(t)
	r, err := New(postgres.From(s.DB), b.pubsub, Config{})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case err = <-errc:
	case <-time.After(10 * time.Second):
		require.NoError(t, r.Close())
		t.Fatalf("Run without migration 007 was still running after 10s; it returned %v once closed", <-errc)
	}
	require.ErrorContains(t, err, "first_failed_at")
	require.ErrorContains(t, err, "millwright migrate")
	require.NoError(t, r.Close())
}
