package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// writeEvents commits n outbox events of topic in one transaction.
func writeEvents(t *testing.T, db *sql.DB, topic string, n int) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{})
	require.NoError(t, err)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("e-%d", i), []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	require.NoError(t, tx.Commit())
}

func countStatus(t *testing.T, db *sql.DB, status string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE status = $1`, status).Scan(&n))
	return n
}

func httpGet(t *testing.T, u string) (int, string) {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// The real binary against Postgres (through a fault proxy) and RabbitMQ:
// ready, publishes, not ready while the database is unreachable and ready
// again after, /metrics, and SIGTERM drains and exits 0.
func TestRelayCommand(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations())
	u, err := url.Parse(s.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	dbURL, err := proxy.URL(s.URL)
	require.NoError(t, err)
	var b [4]byte
	_, _ = rand.Read(b[:])
	topic := "relaycmd_" + hex.EncodeToString(b[:])
	transporttest.DeleteAMQPTopology(t, []string{topic})

	addr := freeAddr(t)
	bin := pgconntest.Build(t, ".")
	p := pgconntest.Start(t, bin, []string{
		relayenv.DatabaseURL + "=" + dbURL,
		transport.EnvTransport + "=amqp",
		transport.EnvAMQPURL + "=" + transporttest.AMQPURL(),
		transport.EnvAMQPAllowUnroutable + "=true",
		relayenv.Addr + "=" + addr,
		relayenv.PollInterval + "=50ms",
		relayenv.ReadyMaxAge + "=3s",
		relayenv.DrainTimeout + "=5s",
	}, "relay")
	base := "http://" + addr

	var body string
	poll.Until(t, 30*time.Second, func() bool {
		resp, err := http.Get(base + health.PathReady)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		bb, _ := io.ReadAll(resp.Body)
		body = string(bb)
		return resp.StatusCode == http.StatusOK
	}, "/readyz never 200; last body:\n%s", body)
	require.Equal(t, "[+]broker ok\n[+]database ok\n[+]relay-0 ok\nreadyz check passed\n", body)
	code, live := httpGet(t, base+health.PathLive)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", live)

	writeEvents(t, s.DB, topic, 20)
	poll.Until(t, 30*time.Second, func() bool { return countStatus(t, s.DB, "published") == 20 }, "the relay published the 20 events")
	// The counter follows the mark's commit, which the table showed first.
	var metrics string
	poll.Until(t, 30*time.Second, func() bool {
		var code int
		code, metrics = httpGet(t, base+relayenv.PathMetrics)
		return code == http.StatusOK && strings.Contains(metrics, "\n"+relay.MetricPublished+" 20\n")
	}, "/metrics does not count the 20 events published")
	require.Contains(t, metrics, "\n"+relay.MetricPendingCount+" ")
	require.Contains(t, metrics, "\ngo_goroutines ")

	// The database goes away (only for the relay: the proxy refuses its
	// connections): not ready, naming the database; still alive.
	refusedBefore := proxy.Refused()
	proxy.Outage(time.Hour)
	poll.Until(t, 30*time.Second, func() bool {
		c, b := httpGet(t, base+health.PathReady)
		body = b
		return c == http.StatusServiceUnavailable && strings.Contains(b, "[-]database failed: ")
	}, "/readyz did not fail while the database was unreachable; last body:\n%s", body)
	require.Greater(t, proxy.Refused(), refusedBefore, "the fault reached the relay")
	code, _ = httpGet(t, base+health.PathLive)
	require.Equal(t, http.StatusOK, code, "liveness does not depend on the database")

	// Back: ready again, and events flow.
	proxy.Outage(0)
	poll.Until(t, 30*time.Second, func() bool {
		c, b := httpGet(t, base+health.PathReady)
		body = b
		return c == http.StatusOK
	}, "/readyz not 200 after the database came back; last body:\n%s", body)
	writeEvents(t, s.DB, topic, 5)
	poll.Until(t, 30*time.Second, func() bool { return countStatus(t, s.DB, "published") == 25 }, "the relay published the events written after the outage")

	sent := p.Signal(t, syscall.SIGTERM)
	ended, exit, out, ok := p.Wait(15 * time.Second)
	require.True(t, ok, out)
	require.Equal(t, 0, exit, out)
	require.Less(t, ended.Sub(sent), 5*time.Second+2*time.Second, "the drain is bounded by %s", relayenv.DrainTimeout)
	require.Contains(t, out, "millwright relay: terminated signal received: draining (at most 5s)")
	require.Contains(t, out, "millwright relay: drained in ")
	require.Contains(t, out, "(25 events published since start)")
}

// startRunRelay runs runRelay in process until ctx ends and returns the base
// URL of its HTTP server and the channel its result arrives on.
func startRunRelay(t *testing.T, ctx context.Context, cfg relayenv.Config, tcfg transport.Config, wrap func(message.Publisher) message.Publisher) (base string, done chan error) {
	t.Helper()
	ready := make(chan string, 1)
	done = make(chan error, 1)
	go func() {
		done <- runRelay(ctx, cfg, tcfg, io.Discard, &relayHooks{ready: ready, wrapPublisher: wrap})
	}()
	select {
	case addr := <-ready:
		return "http://" + addr, done
	case err := <-done:
		t.Fatalf("runRelay: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("runRelay did not serve within 30s")
	}
	return "", nil
}

// blockingPublisher holds every Publish until release is closed.
type blockingPublisher struct {
	message.Publisher
	entered chan struct{}
	once    sync.Once
	release chan struct{}
	calls   atomic.Int64
}

func (b *blockingPublisher) Publish(topic string, msgs ...*message.Message) error {
	b.calls.Add(1)
	b.once.Do(func() { close(b.entered) })
	<-b.release
	return b.Publisher.Publish(topic, msgs...)
}

// setupDrain starts runRelay in process on a fresh schema with a publisher
// that blocks, writes events, and waits until a batch is in flight.
func setupDrain(t *testing.T, drain time.Duration, driver ...string) (s *pgtest.Schema, bp *blockingPublisher, cancel context.CancelFunc, done chan error, base string) {
	t.Helper()
	s = pgtest.New(t, outbox.Migrations())
	writeEvents(t, s.DB, "drain_topic", 10)
	bp = &blockingPublisher{entered: make(chan struct{}), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cfg, err := relayenv.Load(func(k string) (string, bool) {
		v, ok := map[string]string{
			relayenv.DatabaseURL:  s.URL,
			relayenv.Addr:         "127.0.0.1:0",
			relayenv.PollInterval: "20ms",
			relayenv.DrainTimeout: drain.String(),
			relayenv.Driver:       strings.Join(driver, ""), // empty: the default, pgx
		}[k]
		return v, ok && v != ""
	})
	require.NoError(t, err)
	base, done = startRunRelay(t, ctx, cfg, transport.Config{Kind: transport.GoChannel},
		func(p message.Publisher) message.Publisher { bp.Publisher = p; return bp })
	select {
	case <-bp.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("no publish within 30s")
	}
	return s, bp, cancel, done, base
}

// The signal (ctx) makes readiness fail at once, and the batch in flight
// finishes and is marked before runRelay returns: nothing is left leased
// for another relay to republish.
func TestRelayDrainFinishesTheBatchInFlight(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testRelayDrainFinishesTheBatchInFlight(t, driver)
	})
}

func testRelayDrainFinishesTheBatchInFlight(t *testing.T, driver string) {
	s, bp, cancel, done, base := setupDrain(t, 30*time.Second, driver)
	cancel() // SIGTERM
	var body string
	poll.Until(t, 10*time.Second, func() bool {
		c, b := httpGet(t, base+health.PathReady)
		body = b
		return c == http.StatusServiceUnavailable && strings.Contains(b, "[-]draining")
	}, "/readyz not draining after the signal; last body:\n%s", body)
	select {
	case err := <-done:
		t.Fatalf("runRelay returned with a batch in flight: %v", err)
	default:
	}
	close(bp.release)
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("runRelay did not return within 30s of the release")
	}
	require.Equal(t, 10, countStatus(t, s.DB, "published"), "the batch in flight was published and marked")
}

// A publish that never returns (and ignores its context) is abandoned
// after the drain bound: the process does not hang, says so, and the rows
// stay pending for the next relay.
func TestRelayDrainIsBounded(t *testing.T) {
	t.Parallel()
	s, bp, cancel, done, _ := setupDrain(t, 300*time.Millisecond)
	t.Cleanup(func() { close(bp.release) })
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		// The relay stops waiting for the call at its batch's bound and
		// says so when it returns.
		require.ErrorContains(t, err, "broker call(s) still running")
		require.ErrorContains(t, err, "republished after the lease")
	case <-time.After(30 * time.Second):
		t.Fatal("runRelay did not return within 30s")
	}
	// The 300 ms bound ended the drain, not the default 20 s (a 5.3 s
	// bound left a loaded machine 5 s for the relay's own close).
	require.Less(t, time.Since(start), 10*time.Second)
	require.Equal(t, 0, countStatus(t, s.DB, "published"))
	require.Equal(t, 10, countStatus(t, s.DB, "pending"), "abandoned rows stay pending")
}

func TestRelayEnvErrors(t *testing.T) {
	t.Parallel()
	_, err := relayenv.Load(func(k string) (string, bool) {
		v, ok := map[string]string{
			relayenv.Relays:       "0",
			relayenv.DrainTimeout: "soon",
			relayenv.Addr:         "9090",
		}[k]
		return v, ok
	})
	require.ErrorContains(t, err, relayenv.DatabaseURL+" is not set")
	require.ErrorContains(t, err, relayenv.Relays+`="0": want an integer in 1..64`)
	require.ErrorContains(t, err, relayenv.DrainTimeout+`="soon": want a duration`)
	require.ErrorContains(t, err, relayenv.Addr+`="9090": want host:port`)
}

// With the sql transport on the outbox's own database (the orders demo's
// setup), the relay shares its pool with the transport, publishes in the
// database, and is ready.
func TestRelaySQLTransportIsReady(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	writeEvents(t, s.DB, "relay_sql_topic", 5)
	cfg, err := relayenv.Load(func(k string) (string, bool) {
		v, ok := map[string]string{relayenv.DatabaseURL: s.URL, relayenv.Addr: "127.0.0.1:0", relayenv.PollInterval: "20ms"}[k]
		return v, ok
	})
	require.NoError(t, err)
	tcfg, err := transport.ParseURL(s.URL)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	base, done := startRunRelay(t, ctx, cfg, tcfg, nil)
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("runRelay did not return within 30s")
		}
	})
	poll.Until(t, 30*time.Second, func() bool { return countStatus(t, s.DB, "published") == 5 }, "the relay published the 5 events")
	var body string
	poll.Until(t, 30*time.Second, func() bool {
		c, b := httpGet(t, base+health.PathReady)
		body = b
		return c == http.StatusOK
	}, "/readyz not 200; last body:\n%s", body)
	require.Equal(t, "[+]broker ok\n[+]database ok\n[+]relay-0 ok\nreadyz check passed\n", body)
}

// The relay process runs a retention cleaner for every table of the schema
// whose retention is not 0, and none for a table the schema lacks.
func TestRelayRunsTheCleanersOfTheTablesItFinds(t *testing.T) {
	t.Parallel()
	names := func(s *pgtest.Schema, set map[string]string) []string {
		env := map[string]string{relayenv.DatabaseURL: s.URL}
		for k, v := range set {
			env[k] = v
		}
		cfg, err := relayenv.Load(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		require.NoError(t, err)
		p := &relayProcess{cfg: cfg, logger: watermill.NopLogger{}}
		t.Cleanup(p.close)
		tables, err := p.openDB(context.Background())
		require.NoError(t, err)
		require.NoError(t, p.components(tables))
		var got []string
		for _, c := range p.comps {
			got = append(got, c.name)
		}
		return got
	}
	all := pgtest.New(t, migrations.All()...)
	require.Equal(t, []string{"outbox cleaner", "idempotency cleaner", "dead-letter cleaner", "saga cleaner", "audit cleaner"}, names(all, nil))
	require.Equal(t, []string{"outbox cleaner", "idempotency cleaner", "audit cleaner"},
		names(all, map[string]string{relayenv.DLQRetention: "0", relayenv.SagaRetention: "0"}))
	onlyOutbox := pgtest.New(t, outbox.Migrations())
	require.Equal(t, []string{"outbox cleaner"}, names(onlyOutbox, nil))
}

// A relay started while its broker is down serves /readyz meanwhile,
// saying it waits for the broker (503), instead of serving nothing until
// transport.Open returns; the signal ends the wait with an error.
func TestRelayReadinessSaysItWaitsForTheBroker(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	addr := freeAddr(t)
	cfg, err := relayenv.Load(func(k string) (string, bool) {
		v, ok := map[string]string{relayenv.DatabaseURL: s.URL, relayenv.Addr: addr}[k]
		return v, ok
	})
	require.NoError(t, err)
	down := freeAddr(t) // nothing listens there
	tcfg := transport.Config{Kind: transport.AMQP}
	tcfg.AMQP.URL = "amqp://guest:guest@" + down + "/"
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- runRelay(ctx, cfg, tcfg, io.Discard, nil) }()
	var code int
	var body string
	poll.Until(t, 30*time.Second, func() bool {
		resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + addr + health.PathReady)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		code, body = resp.StatusCode, string(b)
		return strings.Contains(body, "waiting for the broker") && strings.Contains(body, "failed attempt")
	}, "/readyz did not say it waits for the broker; last answer %d:\n%s", code, body)
	require.Equal(t, http.StatusServiceUnavailable, code)
	select {
	case err := <-done:
		t.Fatalf("runRelay returned while its broker is down: %v", err)
	default:
	}
	cancel()
	select {
	case err := <-done:
		require.Error(t, err, "the wait ended by the signal is an error")
	case <-time.After(30 * time.Second):
		t.Fatal("runRelay did not return within 30s of the signal")
	}
}

// A search_path naming no schema that exists (a mistyped --schema) gets
// the error with the fix, not "converting NULL to string is unsupported"
// (current_schema() is NULL then).
func TestRelayOnASchemaThatDoesNotExist(t *testing.T) {
	t.Parallel()
	u := pgtest.WithSearchPath(pgtest.BaseURL(), "no_such_schema_"+strings.ToLower(watermill.NewShortUUID()))
	cfg, err := relayenv.Load(func(k string) (string, bool) {
		v, ok := map[string]string{relayenv.DatabaseURL: u, relayenv.Addr: "127.0.0.1:0"}[k]
		return v, ok
	})
	require.NoError(t, err)
	err = runRelay(context.Background(), cfg, transport.Config{Kind: transport.GoChannel}, io.Discard, nil)
	require.ErrorContains(t, err, "no millwright_outbox in the search_path")
	require.ErrorContains(t, err, "millwright migrate")
}
