// Command orders is millwright's order workflow example: an order service,
// a saga orchestrator, inventory, billing and shipping participants and a
// notification consumer, on any of the five transports.
//
//	go run ./examples/orders demo -orders 100              # everything in one process, sql transport
//	go run ./examples/orders demo -driver pq               # database/sql (lib/pq) instead of pgx
//	go run ./examples/orders demo -embedded kafka          # in-process Kafka fake
//	MILLWRIGHT_TRANSPORT=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/orders demo
//	go run ./examples/orders serve orders -http :8080      # one service per process
//	go run ./examples/orders serve relay
//
// See README.md for the walkthrough.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all"      // configuration chooses among every kind
	_ "github.com/millwright/millwright/transport/embedded" // and the development fakes (-embedded, kfake, pstest)
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// envDriver chooses the services' Postgres driver, as for the millwright
// CLI.
const envDriver = "MILLWRIGHT_DATABASE_DRIVER"

const usage = `usage:
  orders demo  [flags]              place N orders, wait until they settle, print one summary line
  orders serve [flags] [service...] run services until interrupted (default: all of them)

services: orders (HTTP API), orchestrator, inventory, billing, shipping, notify, relay, dlq

The transport comes from -transport or MILLWRIGHT_TRANSPORT (kafka, amqp,
googlecloud, nats, sql, gochannel, or a URL; see the transport package), default
the sql transport on the database. -embedded kafka|googlecloud starts an
in-process fake broker (demo, or serve with every service in one process).
The services run on pgx v5 by default; -driver pq or
MILLWRIGHT_DATABASE_DRIVER=pq runs them on database/sql (lib/pq).
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "demo":
		err = demo(os.Args[2:], os.Stdout)
	case "serve":
		err = serve(os.Args[2:])
	case "-h", "-help", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "orders: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

// common are the flags of every command.
type common struct {
	databaseURL, driver, schema, transport, embedded, logLevel string
	topicPrefix                                                string
	park                                                       bool
	sagaVersion                                                string
	// onWait, if set, hears each failed attempt while transport.Open
	// waits for the broker (transport.Config.OnWait).
	onWait func(error)
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.databaseURL, "database-url", envOr(transport.EnvDatabaseURL, defaultDatabaseURL), "Postgres URL (env "+transport.EnvDatabaseURL+")")
	fs.StringVar(&c.driver, "driver", envOr(envDriver, "pgx"), "Postgres driver of the services: pgx (pgx v5, a pgxpool.Pool) or pq (database/sql on lib/pq) (env "+envDriver+")")
	fs.StringVar(&c.schema, "schema", envOr("MILLWRIGHT_ORDERS_SCHEMA", "millwright_orders"), "Postgres schema of the example's tables, created if missing (\"\" = the URL's search_path)")
	fs.StringVar(&c.transport, "transport", os.Getenv(transport.EnvTransport), "transport kind or URL (env "+transport.EnvTransport+"; default: sql on the database)")
	fs.StringVar(&c.topicPrefix, "topic-prefix", os.Getenv("MILLWRIGHT_ORDERS_TOPIC_PREFIX"), "prefix of every topic, so that several runs can share a broker (env MILLWRIGHT_ORDERS_TOPIC_PREFIX)")
	fs.BoolVar(&c.park, "park", os.Getenv("MILLWRIGHT_ORDERS_PARK") == "true", "guard the consumers with package park instead of dlq's middleware (app.Config.Park; env MILLWRIGHT_ORDERS_PARK=true)")
	fs.StringVar(&c.sagaVersion, "saga-version", envOr("MILLWRIGHT_ORDERS_SAGA_VERSION", "2"), "version of the order saga new orders start on: 1 (reserve, charge, ship) or 2 (reserve and charge at once, then ship); both always run (env MILLWRIGHT_ORDERS_SAGA_VERSION)")
	fs.StringVar(&c.embedded, "embedded", "", "start an in-process broker: kafka or googlecloud (not for production)")
	fs.StringVar(&c.logLevel, "log", "error", "log level: debug, info, warn, error")
}

// env is what a command runs with.
type env struct {
	tr  *transport.Transport
	app *app.App
	url string
	log watermill.LoggerAdapter
}

// open connects, migrates, opens the transport and the app, and stocks the
// shop; cleanup closes what it opened.
func (c *common) open(ctx context.Context, duplicate bool) (*env, func(), error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, nil, fmt.Errorf("-log %q: want debug, info, warn or error", c.logLevel)
	}
	log := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})))
	var closers []func()
	cleanup := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	if c.driver != "pgx" && c.driver != "pq" {
		return nil, nil, fmt.Errorf("-driver %q (or %s): want pgx or pq", c.driver, envDriver)
	}
	dbURL := c.databaseURL
	if c.schema != "" {
		if !schemaRe.MatchString(c.schema) {
			return nil, nil, fmt.Errorf("-schema %q (or MILLWRIGHT_ORDERS_SCHEMA): want a plain Postgres identifier: a letter or _, then letters, digits or _, at most 63 bytes", c.schema)
		}
		// The name goes unquoted into search_path, where Postgres folds it
		// to lower case: fold it here too, so that the schema created is the
		// one the search_path names.
		c.schema = strings.ToLower(c.schema)
		if err := createSchema(ctx, dbURL, c.schema); err != nil {
			return nil, nil, err
		}
		dbURL = withSearchPath(dbURL, c.schema)
	}
	pool, closePool, err := c.openPool(ctx, dbURL)
	if err != nil {
		return nil, nil, err
	}
	closers = append(closers, closePool)
	cfg, closeBroker, err := c.transportConfig(dbURL)
	if err != nil {
		cleanup()
		return nil, nil, err
	}
	closers = append(closers, closeBroker)
	cfg.Logger = log
	// A broker that is down or restarting is waited for, each failed
	// attempt logged, until ctx ends (transport.Config.WaitForBroker):
	// a service started before its broker does not exit.
	cfg.OnWait = c.onWait
	tr, err := transport.Open(ctx, cfg)
	if err != nil {
		cleanup()
		return nil, nil, err
	}
	closers = append(closers, func() { _ = tr.Close() })
	pool.DatabaseURL, pool.Transport, pool.Logger, pool.Duplicate = dbURL, tr, log, duplicate
	pool.TopicPrefix, pool.Park = c.topicPrefix, c.park
	if pool.SagaVersion, err = strconv.Atoi(c.sagaVersion); err != nil || (pool.SagaVersion != 1 && pool.SagaVersion != 2) {
		cleanup()
		return nil, nil, fmt.Errorf("-saga-version %q (env MILLWRIGHT_ORDERS_SAGA_VERSION): want 1 (reserve, charge, ship) or 2 (reserve and charge at once, then ship)", c.sagaVersion)
	}
	a, err := app.New(pool)
	if err != nil {
		cleanup()
		return nil, nil, err
	}
	// Stock for every order the commands place.
	if err := a.Seed(ctx, map[string]int64{"book": 1_000_000, "lamp": 1_000_000}); err != nil {
		cleanup()
		return nil, nil, err
	}
	return &env{tr: tr, app: a, url: dbURL, log: log}, cleanup, nil
}

// openPool migrates the schema (migrate runs on database/sql) and returns
// an app.Config with the services' pool on the chosen driver: Pgx (a
// *pgxpool.Pool) or DB (a *sql.DB), 20 connections at most either way.
func (c *common) openPool(ctx context.Context, dbURL string) (app.Config, func(), error) {
	db, err := postgres.Open(dbURL)
	if err != nil {
		return app.Config{}, nil, err
	}
	db.SetMaxOpenConns(20)
	// Only a database that does not answer gets the hint about the URL: a
	// migration the server refuses (a missing schema, say) names its own
	// cause.
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return app.Config{}, nil, fmt.Errorf("connecting (is Postgres running at -database-url?): %w", err)
	}
	if _, err := migrate.Up(ctx, postgres.From(db), app.AllMigrations()...); err != nil {
		db.Close()
		return app.Config{}, nil, fmt.Errorf("migrating: %w", err)
	}
	if c.driver == "pq" {
		return app.Config{DB: db}, func() { db.Close() }, nil
	}
	db.Close()
	pool, err := postgres.OpenPgx(ctx, withParam(dbURL, "pool_max_conns", "20"))
	if err != nil {
		return app.Config{}, nil, err
	}
	return app.Config{Pgx: pool}, pool.Close, nil
}

func (c *common) transportConfig(dbURL string) (transport.Config, func(), error) {
	// -embedded is a shorthand for the development fakes, which
	// MILLWRIGHT_TRANSPORT (or -transport) selects by itself; Close stops them.
	switch c.embedded {
	case "kafka":
		c.transport = transport.FakeKafka
	case "googlecloud":
		c.transport = transport.FakePubSub
	case "":
	default:
		return transport.Config{}, nil, fmt.Errorf("-embedded %q: want kafka or googlecloud (or -transport %s or %s)", c.embedded, transport.FakeKafka, transport.FakePubSub)
	}
	if c.transport == "" {
		cfg, err := transport.ParseURL(dbURL)
		return cfg, func() {}, err
	}
	os.Setenv(transport.EnvTransport, c.transport)
	if os.Getenv(transport.EnvSQLURL) == "" {
		os.Setenv(transport.EnvSQLURL, dbURL)
	}
	cfg, err := transport.FromEnv()
	return cfg, func() {}, err
}

// placeOrders posts n orders of the run to the API at base: every
// failEvery-th fails payment, else every shipEvery-th fails shipping (0:
// none).
func placeOrders(ctx context.Context, base, run string, n, failEvery, shipEvery int) error {
	for i := 1; i <= n; i++ {
		o := app.Order{ID: fmt.Sprintf("%s-%05d", run, i), SKU: []string{"book", "lamp"}[i%2], Qty: 1 + i%3, AmountCents: int64(1000 + 37*i)}
		switch {
		case failEvery > 0 && i%failEvery == 0:
			o.FailPayment = true
		case shipEvery > 0 && i%shipEvery == 0:
			o.FailShipping = true
		}
		if err := post(ctx, base+"/orders", o); err != nil {
			return err
		}
	}
	return nil
}

// publishPoison sends billing one malformed command of the run, which
// must end in the dead-letter queue.
func publishPoison(e *env, run string) error {
	id := run + "-poison"
	msg := message.NewMessage(id, []byte("{not json"))
	msg.Metadata.Set(metadata.EventID, id)
	msg.Metadata.Set(metadata.SagaID, id)
	msg.Metadata.Set(metadata.SagaPhase, "forward")
	if err := e.tr.Publisher().Publish(e.app.Topics().BillingCommands, msg); err != nil {
		return fmt.Errorf("publishing the poison message: %w", err)
	}
	return nil
}

func demo(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ExitOnError)
	var c common
	c.register(fs)
	n := fs.Int("orders", 50, "orders to place")
	failEvery := fs.Int("fail-payment-every", 5, "every k-th order fails payment (0: none)")
	shipEvery := fs.Int("fail-shipping-every", 9, "every k-th order fails shipping, so its payment is refunded (0: none)")
	duplicate := fs.Bool("duplicate", true, "deliver every message twice (Watermill's Duplicator)")
	poison := fs.Bool("poison", true, "send one malformed command, which must end in the dead-letter queue")
	timeout := fs.Duration("timeout", 5*time.Minute, "how long to wait for the orders to settle")
	_ = fs.Parse(args)
	if *n < 0 || *failEvery < 0 || *shipEvery < 0 {
		return errors.New("-orders, -fail-payment-every and -fail-shipping-every must not be negative")
	}

	// SIGINT and SIGTERM cancel ctx; the process exits within a second
	// of the signal, saying what it waited for.
	ctx, stop := shutdown.Context(context.Background(), "orders")
	defer stop()
	e, cleanup, err := c.open(ctx, *duplicate)
	if err != nil {
		return err
	}
	defer cleanup()
	proc, err := e.app.Start(ctx)
	if err != nil {
		return err
	}
	defer proc.Stop() //nolint:errcheck // reported by Wait below
	select {
	case <-proc.Running():
	case <-proc.Done():
		return proc.Wait()
	}

	// The order service's HTTP API, on a free local port.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := newHTTPServer("", e.app.Handler())
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	run := watermill.NewShortUUID()
	started := time.Now()
	if err := placeOrders(ctx, base, run, *n, *failEvery, *shipEvery); err != nil {
		return err
	}
	wantDLQ := 0
	if *poison {
		wantDLQ = 1
		if err := publishPoison(e, run); err != nil {
			return err
		}
	}

	wctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	waitStart := time.Now()
	s, waitErr := e.app.WaitSettled(wctx, run+"-%", wantDLQ)
	if waitErr != nil {
		after := time.Since(waitStart).Round(100 * time.Millisecond)
		if ctx.Err() == nil && shutdown.DeadlinePassed(wctx) {
			after = *timeout
		}
		err := notSettled(ctx, wctx, e, run+"-%", after, waitErr, stdout)
		if serr := proc.Stop(); serr != nil {
			fmt.Fprintln(os.Stderr, "orders: stopping:", serr)
		}
		return err
	}
	fmt.Fprintln(stdout, s)
	fmt.Fprintf(os.Stderr, "orders: driver %s, transport %s, settled in %s\n", c.driver, e.tr, time.Since(started).Round(time.Millisecond))
	if err := proc.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "orders: stopping:", err)
	}
	switch {
	case s.Pending != 0 || s.DuplicateEffects != 0 || s.BrokenCompensations != 0:
		return fmt.Errorf("lost=%d duplicate_effects=%d broken_compensations=%d: want 0", s.Pending, s.DuplicateEffects, s.BrokenCompensations)
	}
	return nil
}

// notSettled prints the true counts of orders that did not settle and
// returns the error saying so. WaitSettled's last count may have been cut
// short by the same deadline (and read as zeros: "orders=0 ... lost=0"
// while 50 orders were pending), so they are counted again with a fresh
// context: 5 s, or after a signal what fits in shutdown.Grace.
func notSettled(ctx, wctx context.Context, e *env, pattern string, after time.Duration, waitErr error, stdout io.Writer) error {
	cause := waitErr
	switch {
	case wctx.Err() != nil:
		cause = context.Cause(wctx)
	case shutdown.DeadlinePassed(wctx):
		cause = context.DeadlineExceeded
	}
	limit := 5 * time.Second
	if ctx.Err() != nil {
		limit = shutdown.Grace / 2
	}
	cctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	s, err := e.app.Count(cctx, pattern)
	// A pooled connection whose last query the deadline cut can come back
	// closed ("use of closed network connection": lib/pq closes it from
	// the cancelled query's watcher, late). Counting only reads: ask
	// again, on another connection, while the fresh context lasts.
	for err != nil && cctx.Err() == nil {
		select {
		case <-cctx.Done():
		case <-time.After(50 * time.Millisecond):
			s, err = e.app.Count(cctx, pattern)
		}
	}
	if err != nil {
		fmt.Fprintf(stdout, "not settled after %s: counts unavailable: %v\n", after, err)
		return fmt.Errorf("orders not settled after %s (%w); counting them failed: %v", after, cause, err)
	}
	fmt.Fprintf(stdout, "not settled after %s: orders=%d completed=%d compensated=%d dlq=%d pending=%d unnotified_events=%d duplicate_effects=%d\n",
		after, s.Orders, s.Completed, s.Compensated, s.DeadLetters, s.Pending, s.UnnotifiedEvents, s.DuplicateEffects)
	hint := ""
	if e.tr.Kind() == transport.SQL && s.Pending > 0 {
		hint = " (sql transport: one long transaction anywhere on the Postgres server holds every consumer back; " +
			"if one does, the log says \"sql: consumers blocked by a long transaction\" with its pid: see docs/runbooks.md#millwrightsqlhorizonheld)"
	}
	return fmt.Errorf("orders not settled after %s: %d of %d pending, %d order events not notified%s: %w",
		after, s.Pending, s.Orders, s.UnnotifiedEvents, hint, cause)
}

func post(ctx context.Context, u string, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("POST %s: %w", u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return fmt.Errorf("POST %s: %s: %s", u, resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	var c common
	c.register(fs)
	addr := fs.String("http", envOr("MILLWRIGHT_HTTP_ADDR", ""), "HTTP address: the orders API and /metrics (orders), /metrics only (other services); default :8080 with orders, none otherwise")
	duplicate := fs.Bool("duplicate", false, "deliver every message twice (Watermill's Duplicator)")
	// Flags may come before or after the service names.
	var names []string
	for rest := args; ; {
		_ = fs.Parse(rest)
		if fs.NArg() == 0 {
			break
		}
		names = append(names, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	var services []app.Service
	for _, name := range names {
		s, err := app.ParseService(name)
		if err != nil {
			return err
		}
		services = append(services, s)
	}
	if len(services) == 0 {
		services = app.AllServices
	}
	withOrders := false
	for _, s := range services {
		withOrders = withOrders || s == app.Orders
	}
	if *addr == "" && withOrders {
		*addr = ":8080"
	}

	// SIGINT and SIGTERM cancel ctx; the services stop taking messages
	// and their handlers in flight finish (the router waits for them),
	// then serve returns and the process exits 0. Only a service still
	// running after the grace ($MILLWRIGHT_SHUTDOWN_GRACE, default 25 s:
	// inside a pod's 30 s) is made to exit, saying what it waited for.
	ctx, stop, err := shutdown.Service(context.Background(), shutdown.Config{Name: "orders"})
	if err != nil {
		return err
	}
	defer stop()

	// Liveness and readiness are served from the start: while the
	// transport waits for the broker, /readyz answers 503 "waiting for
	// the broker" with the last failure; then, until the services run,
	// "starting". The API and /metrics follow once the services started.
	ready, err := health.NewHandler(health.Config{})
	if err != nil {
		return err
	}
	broker := health.Waiting("the broker")
	ready.Add("broker", broker)
	c.onWait = broker.Failed
	var starting http.Handler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "orders: starting (see "+health.PathReady+")", http.StatusServiceUnavailable)
	})
	var appHandler atomic.Pointer[http.Handler]
	appHandler.Store(&starting)
	if *addr != "" {
		mux := http.NewServeMux()
		mux.Handle(health.PathLive, ready.Live())
		mux.Handle(health.PathReady, ready.Ready())
		mux.Handle("/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*appHandler.Load()).ServeHTTP(w, r) }))
		srv := newHTTPServer(*addr, mux)
		go func() {
			if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				fmt.Fprintln(os.Stderr, "orders: HTTP server:", err)
				stop()
			}
		}()
		// Requests in flight finish (for a few seconds) once the services
		// have drained, inside the shutdown grace.
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			if srv.Shutdown(sctx) != nil {
				_ = srv.Close()
			}
		}()
	}
	e, cleanup, err := c.open(ctx, *duplicate)
	if err != nil {
		return err
	}
	defer cleanup()
	proc, err := e.app.Start(ctx, services...)
	if err != nil {
		return err
	}
	ready.Add("services", health.CheckerFunc(func(context.Context) error {
		select {
		case <-proc.Done():
			return fmt.Errorf("stopped: %v", proc.Wait())
		case <-proc.Running():
			return nil
		default:
			return errors.New("starting")
		}
	}))
	// The broker is reached: its Waiter is replaced, after the services'
	// check, not ended with Done (a readiness run begun before the
	// services' check, holding the Waiter, would then pass without it).
	ready.Add("broker", health.CheckerFunc(func(context.Context) error { return nil }))
	h := e.app.MetricsHandler()
	if withOrders {
		h = e.app.Handler()
	} else {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", h)
		h = mux
	}
	appHandler.Store(&h)
	fmt.Fprintf(os.Stderr, "orders: serving %v on transport %s (http %q, %s and %s); Ctrl-C stops\n", services, e.tr, *addr, health.PathLive, health.PathReady)
	return proc.Wait()
}

// schemaRe is the schema names -schema accepts: plain identifiers, which
// need no quoting in search_path.
var schemaRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// newHTTPServer bounds every phase of a connection, so that a client that
// stops reading or writing, or an idle keep-alive, cannot hold one open:
// headers 5s, the whole request 10s, the response 30s, idle 60s.
func newHTTPServer(addr string, h http.Handler) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

func createSchema(ctx context.Context, dbURL, schema string) error {
	db, err := postgres.Open(dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("creating schema %s: connecting (is Postgres running at -database-url?): %w", schema, err)
	}
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+quoteIdent(schema)); err != nil {
		return fmt.Errorf("creating schema %s: %w", schema, err)
	}
	return nil
}

func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// withSearchPath sets search_path on a postgres:// URL (lib/pq and pgx
// pass unknown parameters to the server as settings) or a key=value DSN.
func withSearchPath(raw, schema string) string { return withParam(raw, "search_path", schema) }

// withParam sets the parameter key on a postgres:// URL or a key=value DSN.
func withParam(raw, key, value string) string {
	u, err := url.Parse(raw)
	if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
		return raw + " " + key + "=" + value
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
