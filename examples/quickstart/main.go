// Command quickstart shows millwright end to end on one machine, on its
// client: an order and its event are written in one Postgres transaction
// through the outbox, the client's relay publishes the event through the
// configured transport, and an idempotent handler (behind park and retry)
// applies its effect exactly once, even though every message is delivered
// twice.
//
//	go run ./examples/quickstart                         # Postgres transport (default), pgx driver (default)
//	go run ./examples/quickstart -driver pq              # database/sql (lib/pq) instead of pgx
//	go run ./examples/quickstart -transport amqp://guest:guest@127.0.0.1:5672/
//	MILLWRIGHT_TRANSPORT=kfake go run ./examples/quickstart    # in-process Kafka, a development fake
//	MILLWRIGHT_TRANSPORT=pstest go run ./examples/quickstart   # in-process Pub/Sub, a development fake
//
// (-embedded kafka and -embedded googlecloud are shorthands for the last
// two.) -driver or MILLWRIGHT_DATABASE_DRIVER chooses the Postgres driver;
// the client and the code below are the same on both (postgres.DB and
// postgres.Tx). It prints one summary line counted from the database
// (TestOutputLine runs it and compares):
//
//	driver=pgx transport=sql orders=20 published=20 effects=20 duplicates_skipped=20 lost=0 duplicate_effects=0
//
// or, when they do not settle within -timeout, the counts at that moment:
//
//	not settled after 2m0s: driver=pgx transport=sql orders=20 published=20 effects=0 pending=20
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all"      // configuration chooses among every kind
	_ "github.com/millwright/millwright/transport/embedded" // and the development fakes (-embedded, kfake, pstest)
)

const topic = "quickstart.order_created"

// orderCreated is the event of order id.
func orderCreated(id string) outbox.Event {
	return outbox.Event{
		Topic: topic, AggregateType: "order", AggregateID: id, EventType: "order.created.v1",
		Payload: []byte(id), Source: "examples/quickstart",
	}
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// options are the command line's.
type options struct {
	dbURL, transport, driver, embedded string
	orders                             int
	timeout                            time.Duration
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.dbURL, "database-url", envOr("MILLWRIGHT_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres URL of the service database")
	flag.StringVar(&o.transport, "transport", os.Getenv(transport.EnvTransport), "transport kind or URL (default: sql on --database-url)")
	flag.StringVar(&o.driver, "driver", envOr("MILLWRIGHT_DATABASE_DRIVER", "pgx"), "Postgres driver of the service: pgx (pgx v5) or pq (database/sql on lib/pq)")
	flag.StringVar(&o.embedded, "embedded", "", "start an in-process broker: kafka or googlecloud (not for production)")
	flag.IntVar(&o.orders, "orders", 20, "orders to place")
	flag.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for the orders to settle")
	flag.Parse()
	return o
}

func run() error {
	o := parseFlags()
	// SIGINT and SIGTERM cancel ctx; the process exits within a second of
	// the signal, saying what it waited for.
	ctx, stop := shutdown.Context(context.Background(), "quickstart")
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	db, handle, err := openDatabase(ctx, o.driver, o.dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	if p := handle.Pgx(); p != nil {
		defer p.Close()
	}

	// The transport comes from configuration alone.
	tcfg, err := transportConfig(o.transport, o.embedded, o.dbURL)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	client, err := millwright.NewClient(handle, millwright.Config{Name: "quickstart", Transport: tcfg, DatabaseURL: o.dbURL,
		Logger: log, Registry: reg, Relay: relay.Config{PollInterval: time.Second}})
	if err != nil {
		return err
	}
	// Duplicator delivers every message twice, inside the retry and
	// outside the idempotency, to show that the effect still happens once.
	if err := client.Handle("notifier", topic, notify, millwright.HandlerConfig{Inside: []message.HandlerMiddleware{middleware.Duplicator}}); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() { errc <- client.Run(ctx) }()
	select {
	case <-client.Running():
	case err := <-errc:
		return err
	}

	// Place orders: business row and event in one transaction.
	runID := watermill.NewShortUUID()
	for i := range o.orders {
		id := fmt.Sprintf("%s-%03d", runID, i)
		err := handle.InTx(ctx, func(tx postgres.Tx) error {
			return errors.Join(execTx(ctx, tx, `INSERT INTO quickstart_orders (id) VALUES ($1)`, id), client.Add(ctx, tx, orderCreated(id)))
		})
		if err != nil {
			return errors.Join(fmt.Errorf("placing order %s: %w", id, err), client.Close())
		}
	}

	// Wait until every event is published and every notification applied.
	waitCtx, waitCancel := context.WithTimeout(ctx, o.timeout)
	defer waitCancel()
	dups := func() uint64 { return duplicates(reg) }
	effects, distinct, err := waitSettled(waitCtx, db, dups, runID, o.orders)
	kind := client.Transport().Kind()
	if err != nil {
		_ = client.Close()
		if waitCtx.Err() == nil {
			return err // not the deadline: the database failed
		}
		return notSettled(ctx, db, o.driver, kind, runID, o.orders, o.timeout, context.Cause(waitCtx))
	}
	if err := errors.Join(client.Close(), <-errc); err != nil {
		log.Warn("shutdown", "error", err)
	}
	// Read after the client drained: the Duplicator's second delivery of
	// the last message runs after its effect committed.
	return report(ctx, db, o.driver, kind, runID, o.orders, effects, distinct, dups())
}

// notify is the handler: it applies the event's effect in the
// transaction that records the event as processed, whatever the driver.
func notify(ctx context.Context, tx postgres.Tx, msg *message.Message) error {
	return execTx(ctx, tx, `INSERT INTO quickstart_notifications (order_id) VALUES ($1)`, string(msg.Payload))
}

// execTx runs a statement in tx, on either driver.
func execTx(ctx context.Context, tx postgres.Tx, query string, args ...any) error {
	var err error
	if t := tx.Pgx(); t != nil {
		_, err = t.Exec(ctx, query, args...)
	} else {
		_, err = tx.SQL().ExecContext(ctx, query, args...)
	}
	return err
}

// duplicates is the count of deliveries the idempotency middleware
// skipped, from the client's registry.
func duplicates(reg *prometheus.Registry) uint64 {
	mfs, _ := reg.Gather()
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == idempotency.MetricDuplicates {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return uint64(n)
}

// report prints the summary line of a settled run, and fails when the
// effects do not match the orders.
func report(ctx context.Context, db *sql.DB, driver string, kind transport.Kind, runID string, n, effects, distinct int, dups uint64) error {
	var published int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_outbox WHERE status = 'published' AND aggregate_id LIKE $1`, runID+"-%").Scan(&published); err != nil {
		return err
	}
	fmt.Printf("driver=%s transport=%s orders=%d published=%d effects=%d duplicates_skipped=%d lost=%d duplicate_effects=%d\n",
		driver, kind, n, published, effects, dups, n-distinct, effects-distinct)
	if distinct != n || effects != distinct {
		return errors.New("effects do not match orders")
	}
	return nil
}

// openDatabase migrates the database at dbURL and opens the service's
// handle on driver. The migrations and the summary's counts run on the
// returned *sql.DB whatever the driver.
func openDatabase(ctx context.Context, driver, dbURL string) (*sql.DB, postgres.DB, error) {
	if driver != "pgx" && driver != "pq" {
		return nil, postgres.DB{}, fmt.Errorf("-driver %q (or MILLWRIGHT_DATABASE_DRIVER): want pgx or pq", driver)
	}
	// Bounded connections: connect_timeout (10s unless the URL sets one),
	// and calls that give up when ctx ends, even on a silent server.
	db, err := postgres.Open(dbURL)
	if err != nil {
		return nil, postgres.DB{}, err
	}
	db.SetMaxOpenConns(10)
	fail := func(err error) (*sql.DB, postgres.DB, error) { db.Close(); return nil, postgres.DB{}, err }
	// Only a database that does not answer gets the hint about the URL: a
	// migration the server refuses (a missing schema, say) names its own
	// cause.
	if err := db.PingContext(ctx); err != nil {
		return fail(fmt.Errorf("connecting (is Postgres running at --database-url?): %w", err))
	}
	if _, err := migrate.Up(ctx, postgres.SQL(db), migrations.All()...); err != nil {
		return fail(fmt.Errorf("migrating: %w", err))
	}
	if _, err := db.ExecContext(ctx, `
		CREATE TABLE IF NOT EXISTS quickstart_orders (id TEXT PRIMARY KEY, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
		CREATE TABLE IF NOT EXISTS quickstart_notifications (order_id TEXT NOT NULL, sent_at TIMESTAMPTZ NOT NULL DEFAULT now());`); err != nil {
		return fail(err)
	}
	if driver == "pq" {
		return db, postgres.SQL(db), nil
	}
	// Bounded like postgres.Open; pool_max_conns in the URL sets its size.
	pool, err := postgres.OpenPgx(ctx, dbURL)
	if err != nil {
		return fail(err)
	}
	return db, postgres.Pgx(pool), nil
}

// waitSettled waits until every event of the run is published and every
// notification applied, and returns the effects counted (all, distinct
// orders).
func waitSettled(ctx context.Context, db *sql.DB, dups func() uint64, runID string, n int) (effects, distinct int, err error) {
	err = outboxtest.WaitDrained(ctx, postgres.SQL(db))
	for err == nil {
		err = db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT order_id) FROM quickstart_notifications WHERE order_id LIKE $1`, runID+"-%").Scan(&effects, &distinct)
		// Every delivery runs twice (Duplicator): settled once every
		// effect is applied and every second run has been skipped, so the
		// count printed below is complete however the shutdown goes.
		if err != nil || (distinct == n && dups() >= uint64(n)) {
			break
		}
		select {
		case <-ctx.Done():
			err = context.Cause(ctx)
		case <-time.After(50 * time.Millisecond):
		}
	}
	return effects, distinct, err
}

// notSettled prints the true counts of a run that did not settle within
// timeout and returns the error saying so. The wait's own count may have
// been cut short by the same deadline, so they are counted again with a
// fresh context: 5 s, or after a signal what fits in shutdown.Grace.
func notSettled(ctx context.Context, db *sql.DB, driver string, kind transport.Kind, runID string, n int, timeout time.Duration, cause error) error {
	limit := 5 * time.Second
	if ctx.Err() != nil {
		limit, timeout = shutdown.Grace/2, 0
	}
	cctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var published, effects, distinct int
	count := func() error {
		return db.QueryRowContext(cctx, `SELECT
		(SELECT count(*) FROM millwright_outbox WHERE status = 'published' AND aggregate_id LIKE $1),
		(SELECT count(*) FROM quickstart_notifications WHERE order_id LIKE $1),
		(SELECT count(DISTINCT order_id) FROM quickstart_notifications WHERE order_id LIKE $1)`, runID+"-%").Scan(&published, &effects, &distinct)
	}
	err := count()
	// A pooled connection whose last query the deadline cut can come back
	// closed (lib/pq closes it from the cancelled query's watcher, late).
	// Counting only reads: ask again, on another connection, while the
	// fresh context lasts.
	for err != nil && cctx.Err() == nil {
		select {
		case <-cctx.Done():
		case <-time.After(50 * time.Millisecond):
			err = count()
		}
	}
	after := "after " + timeout.String()
	if timeout == 0 {
		after = "when interrupted"
	}
	if err != nil {
		fmt.Printf("not settled %s: driver=%s transport=%s orders=%d, counts unavailable: %v\n", after, driver, kind, n, err)
		return fmt.Errorf("orders not settled %s (%w); counting them failed: %v", after, cause, err)
	}
	fmt.Printf("not settled %s: driver=%s transport=%s orders=%d published=%d effects=%d pending=%d\n", after, driver, kind, n, published, effects, n-distinct)
	hint := ""
	if kind == transport.SQL && distinct < n {
		hint = " (sql transport: one long transaction anywhere on the Postgres server holds every consumer back; " +
			"if one does, the log says \"sql: consumers blocked by a long transaction\" with its pid: see docs/runbooks.md#millwrightsqlhorizonheld)"
	}
	return fmt.Errorf("orders not settled %s: %d of %d notified%s: %w", after, distinct, n, hint, cause)
}

func transportConfig(sel, emb, dbURL string) (transport.Config, error) {
	// -embedded is a shorthand for the development fakes, which
	// MILLWRIGHT_TRANSPORT selects by itself.
	switch emb {
	case "kafka":
		sel = transport.FakeKafka
	case "googlecloud":
		sel = transport.FakePubSub
	case "":
	default:
		return transport.Config{}, fmt.Errorf("-embedded %q: want kafka or googlecloud (or set %s=%s or %s)", emb, transport.EnvTransport, transport.FakeKafka, transport.FakePubSub)
	}
	if sel == "" {
		return transport.ParseURL(dbURL)
	}
	os.Setenv(transport.EnvTransport, sel)
	if os.Getenv(transport.EnvDatabaseURL) == "" {
		os.Setenv(transport.EnvDatabaseURL, dbURL)
	}
	return transport.FromEnv()
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
