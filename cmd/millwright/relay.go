package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/interrupt"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
	"github.com/millwright/millwright/transport"
)

func init() { rootCmd.AddCommand(relayCmd()) }

// relayCmd is `millwright relay`.
func relayCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Run outbox relays and cleaners, with /metrics, /healthz and /readyz, until SIGTERM",
		Long: `Run the outbox relay(s) of one database and its cleaners: the process an
operator deploys beside the services (see deploy/kubernetes).

Configuration comes from the environment:

` + relayenv.Help() + `
--addr, when given, takes the place of ` + relayenv.Addr + `. --schema (default
$` + envSchema + `), when given, sets the search_path of ` + relayenv.DatabaseURL + `.

/healthz answers 200 while the process runs. /readyz answers 200 when the
database answers a ping, the broker accepts a TCP connection (sql: its
database answers a ping) and every relay completed a round within
` + relayenv.ReadyMaxAge + `; 503 otherwise, and from SIGTERM on. The pings go
through a pool of their own (one connection, application_name
` + relayenv.ReadyAppName + `, or the URL's own application_name + "/readyz"), requests arriving while the checks run share
their results, and a result answers the requests of the next
` + relayenv.ReadyCacheFor.String() + `: no number of probes takes a connection from the relays.

The HTTP server cuts a request whose headers take longer than
` + relayenv.HTTPReadHeaderTimeout.String() + `, whose whole body takes longer than ` + relayenv.HTTPReadTimeout.String() + `, or whose
response takes longer than ` + relayenv.HTTPWriteTimeout.String() + ` to write, and closes a keep-alive
connection idle for ` + relayenv.HTTPIdleTimeout.String() + `.

On SIGTERM the relays finish their batches in flight (at most
` + relayenv.DrainTimeout + `), the cleaners stop, and the process exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := relayConfig(cmd, os.LookupEnv)
			if err != nil {
				return err
			}
			tcfg, err := transport.FromEnv()
			if err != nil {
				return fmt.Errorf("millwright relay: %w", err)
			}
			// The drain may take DrainTimeout; main's backstop would cut it
			// after interrupt.Grace.
			interrupt.ExtendGrace(cfg.DrainTimeout + 5*time.Second)
			return runRelay(cmd.Context(), cfg, tcfg, cmd.ErrOrStderr(), nil)
		},
	}
	cmd.Flags().String("addr", "", "HTTP address of /metrics, /healthz and /readyz, host:port or :port (default $"+relayenv.Addr+", else "+relayenv.DefaultAddr+": every interface)")
	return cmd
}

// relayConfig loads the relay's configuration from the environment
// (lookup), --addr taking the place of relayenv.Addr when given.
func relayConfig(cmd *cobra.Command, lookup func(string) (string, bool)) (relayenv.Config, error) {
	if f := cmd.Flags().Lookup("addr"); f != nil && f.Changed {
		addr := strings.TrimSpace(f.Value.String())
		if err := relayenv.CheckAddr(addr); err != nil {
			return relayenv.Config{}, fmt.Errorf("millwright relay: --addr=%q: %w", addr, err)
		}
		env := lookup
		lookup = func(k string) (string, bool) {
			if k == relayenv.Addr {
				return addr, true
			}
			return env(k)
		}
	}
	if f := cmd.Flags().Lookup("driver"); f != nil && f.Changed {
		driver := f.Value.String()
		env := lookup
		lookup = func(k string) (string, bool) {
			if k == relayenv.Driver {
				return driver, true
			}
			return env(k)
		}
	}
	cfg, err := relayenv.Load(lookup)
	if err != nil {
		return relayenv.Config{}, fmt.Errorf("millwright relay: %w", err)
	}
	// --schema and $MILLWRIGHT_SCHEMA, which every command takes, set the
	// search_path here too (they were silently ignored before).
	schema, err := schemaFrom(cmd, lookup)
	if err != nil {
		return relayenv.Config{}, fmt.Errorf("millwright relay: %w", err)
	}
	cfg.DatabaseURL = withSchema(cfg.DatabaseURL, schema)
	return cfg, nil
}

// relayHooks are test hooks: ready receives the HTTP address once it
// listens; wrapPublisher wraps the transport's publisher; transport, when
// set, sees the transport before the relays start (to subscribe);
// httpTimeouts, when set, replaces the HTTP server's bounds.
type relayHooks struct {
	ready         chan<- string
	wrapPublisher func(message.Publisher) message.Publisher
	transport     func(*transport.Transport) error
	httpTimeouts  *httpTimeouts
}

// httpTimeouts are the HTTP server's bounds (relayenv.HTTP*Timeout).
type httpTimeouts struct{ readHeader, read, write, idle time.Duration }

var defaultHTTPTimeouts = httpTimeouts{
	readHeader: relayenv.HTTPReadHeaderTimeout, read: relayenv.HTTPReadTimeout,
	write: relayenv.HTTPWriteTimeout, idle: relayenv.HTTPIdleTimeout,
}

// newHTTPServer is the relay's HTTP server: every phase of a connection is
// bounded, so idle or slow clients cannot hold connections (and their
// goroutines) for ever.
func newHTTPServer(h http.Handler, t httpTimeouts) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: t.readHeader,
		ReadTimeout:       t.read,
		WriteTimeout:      t.write,
		IdleTimeout:       t.idle,
		MaxHeaderBytes:    64 << 10,
	}
}

// component is a Run/Close part of the relay process: a relay or a
// cleaner. The retention cleaners of other tables join the list in
// components when they exist.
type component struct {
	name  string
	run   func(context.Context) error
	close func() error
}

// relayProcess is what runRelay opened.
type relayProcess struct {
	cfg    relayenv.Config
	logger watermill.LoggerAdapter
	// db is the database/sql pool: the relays' and cleaners' with the pq
	// driver, else only the sql transport's (watermill-sql).
	db *sql.DB
	// pgx is the relays' and cleaners' pool with the pgx driver (nil with
	// pq).
	pgx *pgxpool.Pool
	// readyDB is the readiness checks' pool: one connection, so that
	// probes never wait for, or take, a connection of db.
	readyDB *sql.DB
	schema  string
	tr      *transport.Transport
	reg     *prometheus.Registry
	h       *health.Handler
	relays  []*relay.Relay
	comps   []component
}

// runRelay runs until ctx ends (the signal), then drains.
func runRelay(ctx context.Context, cfg relayenv.Config, tcfg transport.Config, logOut io.Writer, hooks *relayHooks) error {
	if hooks == nil {
		hooks = &relayHooks{}
	}
	logf := func(format string, args ...any) { fmt.Fprintf(logOut, "millwright relay: "+format+"\n", args...) }
	p := &relayProcess{cfg: cfg, logger: watermill.NewStdLoggerWithOut(logOut, false, false)}
	defer p.close()
	tables, err := p.openDB(ctx)
	if err != nil {
		return err
	}
	// Readiness and metrics are served from before the transport opens:
	// while Open waits for a broker that is down, /readyz says so.
	if p.h, err = health.NewHandler(health.Config{CacheFor: relayenv.ReadyCacheFor}); err != nil {
		return err
	}
	p.h.Add("database", health.Ping(p.readyDB))
	broker := health.Waiting("the broker")
	p.h.Add("broker", broker)
	p.reg = prometheus.NewRegistry()
	p.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s=%s: %w", relayenv.Addr, cfg.Addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(relayenv.PathMetrics, promhttp.HandlerFor(p.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.Handle(health.PathLive, p.h.Live())
	mux.Handle(health.PathReady, p.h.Ready())
	timeouts := defaultHTTPTimeouts
	if hooks.httpTimeouts != nil {
		timeouts = *hooks.httpTimeouts
	}
	srv := newHTTPServer(mux, timeouts)
	srvErr := make(chan error, 1)
	go func() { srvErr <- srv.Serve(ln) }()
	defer func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
	}()

	tcfg.OnWait = broker.Failed
	if err := p.openTransport(ctx, tcfg, hooks.wrapPublisher); err != nil {
		return err
	}
	// No broker.Done(): openTransport replaced the Waiter with the real
	// broker check, after the relays' checks. A readiness run that began
	// before those Adds still holds the Waiter; left waiting, it fails, so
	// that run (which has no relay checks) cannot pass. With Done it
	// passed when its checks ran after this point, and /readyz answered
	// 200 without the relays (TestRelayCommand under load: "[+]broker ok
	// [+]database ok readyz check passed", no relay-0).
	if hooks.transport != nil {
		if err := hooks.transport(p.tr); err != nil {
			return err
		}
	}
	if err := p.components(tables); err != nil {
		return err
	}

	// Components run on a context the signal does not cancel: the signal
	// starts Close, which lets batches in flight finish.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	var wg sync.WaitGroup
	failed := make(chan error, len(p.comps))
	for _, c := range p.comps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.run(runCtx); err != nil {
				failed <- fmt.Errorf("%s: %w", c.name, err)
			}
		}()
	}
	logf("%d relay(s) on %s (schema %s), transport %s, serving %s, %s and %s on %s",
		len(p.relays), redact.URL(cfg.DatabaseURL), p.schema, p.tr, relayenv.PathMetrics, health.PathLive, health.PathReady, ln.Addr())
	if hooks.ready != nil {
		hooks.ready <- ln.Addr().String()
	}

	var runErr error
	select {
	case <-ctx.Done():
		logf("%v: draining (at most %s)", context.Cause(ctx), cfg.DrainTimeout)
	case runErr = <-failed:
		logf("stopping: %v", runErr)
	case err := <-srvErr:
		runErr = fmt.Errorf("HTTP server on %s: %w", ln.Addr(), err)
	}

	// Drain: not ready from now on; /healthz and /metrics stay up until the
	// components have stopped.
	start := time.Now()
	p.h.Drain()
	if err := p.drain(&wg, cancelRun); err != nil {
		runErr = errors.Join(runErr, err)
	}
	// What the components said as they stopped (a relay that left broker
	// calls running past their bound says so) is part of the exit status.
	for more := true; more; {
		select {
		case err := <-failed:
			runErr = errors.Join(runErr, err)
		default:
			more = false
		}
	}
	var published uint64
	for _, r := range p.relays {
		published += r.Stats().Published
	}
	logf("drained in %s (%d events published since start)", time.Since(start).Round(time.Millisecond), published)
	return runErr
}

// openDB opens and checks the database; it reports which of the tables the
// retention cleaners clean the schema has (beside the outbox, required).
// With the pgx driver the relays and cleaners get a pgx pool of
// cfg.MaxConns connections (postgres.OpenPgx: bounded connects), and the
// database/sql pool only serves the sql transport.
func (p *relayProcess) openDB(ctx context.Context) (tables map[string]bool, err error) {
	u := p.cfg.DatabaseURL
	if p.db, err = pgconn.Open(u); err != nil {
		return nil, fmt.Errorf("opening database %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	p.db.SetMaxOpenConns(p.cfg.MaxConns)
	p.db.SetMaxIdleConns(p.cfg.MaxConns)
	if err := p.db.PingContext(ctx); err != nil {
		return nil, fmt.Errorf("connecting to database %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	if p.cfg.Driver == driverPgx {
		if err := p.openPgx(ctx); err != nil {
			return nil, err
		}
	}
	if p.readyDB, err = pgconn.Open(cli.WithDSNParam(u, "application_name", readyAppName(u))); err != nil {
		return nil, fmt.Errorf("opening the readiness pool on %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	p.readyDB.SetMaxOpenConns(1)
	p.readyDB.SetMaxIdleConns(1)
	names := []string{"millwright_outbox", "millwright_processed_events", "millwright_dead_letters", "millwright_saga_instances", "millwright_audit"}
	info, err := storage.LookupTables(ctx, storage.NewSQLPool(p.db), names...)
	if err != nil {
		return nil, fmt.Errorf("reading the schema of %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	p.schema = info.Schema
	tables = make(map[string]bool, len(names))
	for _, n := range names {
		tables[n] = true
	}
	for _, n := range info.Missing {
		tables[n] = false
	}
	if !tables["millwright_outbox"] {
		return nil, fmt.Errorf("no millwright_outbox in the search_path of %s (schema %q): run `millwright migrate` on that URL, or set search_path in %s to the service's schema",
			redact.URL(u), p.schema, relayenv.DatabaseURL)
	}
	return tables, nil
}

// openPgx opens the pgx pool of the relays and cleaners.
func (p *relayProcess) openPgx(ctx context.Context) error {
	u := p.cfg.DatabaseURL
	pcfg, err := pgconn.PgxConfig(u)
	if err != nil {
		return fmt.Errorf("opening database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	pcfg.MaxConns = int32(min(p.cfg.MaxConns, math.MaxInt32))
	if p.pgx, err = pgconn.ConnectPgx(ctx, pcfg); err != nil {
		return fmt.Errorf("connecting to database %s with pgx: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	return nil
}

// newRelay makes a relay on the pool of the process's driver.
func (p *relayProcess) newRelay(pub message.Publisher, cfg relay.Config) (*relay.Relay, error) {
	return relay.New(p.pool(), pub, cfg)
}

// pool is the relays' and cleaners' pool, on the process's driver.
func (p *relayProcess) pool() postgres.DB {
	if p.pgx != nil {
		return postgres.Pgx(p.pgx)
	}
	return postgres.SQL(p.db)
}

// openTransport opens the transport and the health checks of the database
// and the broker.
func (p *relayProcess) openTransport(ctx context.Context, tcfg transport.Config, wrap func(message.Publisher) message.Publisher) error {
	sameDB := false
	if tcfg.Kind == transport.SQL && (tcfg.SQL.URL == "" || tcfg.SQL.URL == p.cfg.DatabaseURL) {
		tcfg.SQL.URL, tcfg.SQL.DB = "", p.db // one pool: the relay publishes in the database
		sameDB = true
	}
	tcfg.Logger = p.logger
	tr, err := transport.Open(ctx, tcfg)
	if err != nil {
		return err
	}
	p.tr = tr
	pub := tr.Publisher()
	if wrap != nil {
		pub = wrap(pub)
	}
	listenURL := ""
	if p.cfg.Listen {
		listenURL = p.cfg.DatabaseURL
	}
	for i := range p.cfg.Relays {
		r, err := p.newRelay(pub, relay.Config{
			BatchSize: p.cfg.BatchSize, Workers: p.cfg.Workers, PollInterval: p.cfg.PollInterval, ListenURL: listenURL,
			DeadLetterTopic: p.cfg.DeadLetterTopic, CloseTimeout: p.cfg.DrainTimeout, Lease: p.cfg.Lease,
			Registerer: p.reg, Logger: p.logger,
		})
		if err != nil {
			return err
		}
		p.relays = append(p.relays, r)
		p.h.Add(fmt.Sprintf("relay-%d", i), health.Relay(r, p.cfg.ReadyMaxAge))
	}
	// Add replaces the Waiter that answered while Open waited: last, so
	// that /readyz, not ready until then, never passes without the relays'
	// checks.
	if sameDB {
		p.h.Add("broker", health.Ping(p.readyDB))
	} else {
		p.h.Add("broker", brokerCheck(tcfg, p.readyDB))
	}
	return nil
}

// components lists what runs: the relays, then a retention cleaner for
// each table the schema has whose retention is not 0.
func (p *relayProcess) components(tables map[string]bool) error {
	for i, r := range p.relays {
		p.comps = append(p.comps, component{fmt.Sprintf("relay-%d", i), r.Run, r.Close})
	}
	cleaners := []struct {
		name, env, table string
		retention        time.Duration
		open             openCleaner
	}{
		{"outbox cleaner", relayenv.OutboxRetention, "millwright_outbox", p.cfg.OutboxRetention, retention.NewOutboxCleaner},
		{"idempotency cleaner", relayenv.IdempotencyRetention, "millwright_processed_events", p.cfg.IdempotencyRetention, retention.NewIdempotencyCleaner},
		{"dead-letter cleaner", relayenv.DLQRetention, "millwright_dead_letters", p.cfg.DLQRetention, retention.NewDeadLetterCleaner},
		{"saga cleaner", relayenv.SagaRetention, "millwright_saga_instances", p.cfg.SagaRetention, retention.NewSagaCleaner},
		{"audit cleaner", relayenv.AuditRetention, "millwright_audit", p.cfg.AuditRetention, retention.NewAuditCleaner},
	}
	for _, c := range cleaners {
		if c.retention <= 0 || !tables[c.table] {
			continue
		}
		ccfg := retention.Config{Retention: c.retention, Interval: p.cfg.CleanInterval, Logger: p.logger}
		if p.reg != nil { // a nil *Registry is not a nil Registerer
			ccfg.Registerer = p.reg // millwright_loop_panics_total of the cleaners
		}
		cl, err := c.open(p.pool(), ccfg)
		if err != nil {
			return fmt.Errorf("%s: %w", c.env, err)
		}
		p.comps = append(p.comps, component{c.name, cl.Run, cl.Close})
	}
	return nil
}

// drain closes every component at once (a relay's Close lets its batch in
// flight finish, at most DrainTimeout) and waits for their Run to return.
// After DrainTimeout and a second it cancels them; one that still does not
// return (a publish that ignores its context) is left behind, with an
// error saying so.
func (p *relayProcess) drain(running *sync.WaitGroup, cancelRun context.CancelFunc) error {
	start := time.Now()
	var closing sync.WaitGroup
	for _, c := range p.comps {
		closing.Add(1)
		go func() {
			defer closing.Done()
			_ = c.close()
		}()
	}
	closed := make(chan struct{})
	go func() { closing.Wait(); running.Wait(); close(closed) }()
	select {
	case <-closed:
		return nil
	case <-time.After(p.cfg.DrainTimeout + time.Second):
	}
	cancelRun() // a cleaner's batch or a slow publish: abandon it
	select {
	case <-closed:
		return nil
	case <-time.After(2 * time.Second):
		// Its rows stay leased and are republished after the lease.
		return fmt.Errorf("drain: a relay or cleaner still runs %s after the signal (a publish that ignores its context?); exiting without it: its rows are republished after the lease", time.Since(start).Round(time.Millisecond))
	}
}

// close releases what openDB and openTransport opened.
func (p *relayProcess) close() {
	if p.tr != nil {
		_ = p.tr.Close()
	}
	if p.db != nil {
		_ = p.db.Close()
	}
	if p.pgx != nil {
		p.pgx.Close()
	}
	if p.readyDB != nil {
		_ = p.readyDB.Close()
	}
}

// readyAppName is the application_name of the readiness connection:
// relayenv.ReadyAppName, or the URL's own application_name + "/readyz".
func readyAppName(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && strings.HasPrefix(u.Scheme, "postgres") {
		if a := u.Query().Get("application_name"); a != "" {
			return a + "/readyz"
		}
	}
	return relayenv.ReadyAppName
}

// brokerCheck is the broker part of readiness: a TCP connection to the
// broker's address succeeds (kafka: any bootstrap broker; amqp: the URL's
// host; nats: any of the URL's servers; googlecloud: the emulator or pubsub.googleapis.com), or, for the
// sql transport, its database answers a ping. It says the network path is
// open; whether publishes succeed is what the relay check's last
// successful round says.
func brokerCheck(tcfg transport.Config, db *sql.DB) health.Checker {
	var addrs []string
	switch tcfg.Kind {
	case transport.Kafka:
		addrs = tcfg.Kafka.Brokers
	case transport.AMQP:
		if u, err := url.Parse(tcfg.AMQP.URL); err == nil {
			host := u.Host
			if u.Port() == "" {
				port := "5672"
				if u.Scheme == "amqps" {
					port = "5671"
				}
				host = net.JoinHostPort(u.Hostname(), port)
			}
			addrs = []string{host}
		}
	case transport.NATS:
		for _, raw := range strings.Split(tcfg.NATS.URL, ",") {
			if u, err := url.Parse(strings.TrimSpace(raw)); err == nil && u.Hostname() != "" {
				host := u.Host
				if u.Port() == "" {
					host = net.JoinHostPort(u.Hostname(), "4222")
				}
				addrs = append(addrs, host)
			}
		}
	case transport.GoogleCloud:
		addrs = []string{"pubsub.googleapis.com:443"}
		if tcfg.GoogleCloud.EmulatorHost != "" {
			addrs = []string{tcfg.GoogleCloud.EmulatorHost}
		}
	case transport.SQL:
		if tcfg.SQL.DB != nil {
			return health.Ping(tcfg.SQL.DB)
		}
		if tcfg.SQL.URL != "" {
			tdb, err := pgconn.Open(tcfg.SQL.URL)
			if err != nil {
				return health.CheckerFunc(func(context.Context) error { return err })
			}
			tdb.SetMaxOpenConns(1)
			return health.Ping(tdb)
		}
		return health.Ping(db)
	case transport.GoChannel:
		return health.CheckerFunc(func(context.Context) error { return nil }) // in process
	}
	return health.CheckerFunc(func(ctx context.Context) error {
		if len(addrs) == 0 {
			return fmt.Errorf("no broker address in the %s configuration", tcfg.Kind)
		}
		var errs []error
		var d net.Dialer
		for _, a := range addrs {
			c, err := d.DialContext(ctx, "tcp", a)
			if err == nil {
				_ = c.Close()
				return nil
			}
			errs = append(errs, err)
		}
		return fmt.Errorf("%s broker unreachable (%s): %w", tcfg.Kind, strings.Join(addrs, ", "), errors.Join(errs...))
	})
}
