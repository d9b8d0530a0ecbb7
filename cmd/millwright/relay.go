package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/cleaner"
	"github.com/millwright/millwright/internal/interrupt"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/relayenv"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
)

func init() {
	rootCmd.AddCommand(&cobra.Command{
		Use:   "relay",
		Short: "Run outbox relays and cleaners, with /metrics, /healthz and /readyz, until SIGTERM",
		Long: `Run the outbox relay(s) of one database and its cleaners: the process an
operator deploys beside the services (see deploy/kubernetes).

Configuration comes from the environment:

` + relayenv.Help() + `
/healthz answers 200 while the process runs. /readyz answers 200 when the
database answers a ping, the broker accepts a TCP connection (sql: its
database answers a ping) and every relay completed a round within
` + relayenv.ReadyMaxAge + `; 503 otherwise, and from SIGTERM on.

On SIGTERM the relays finish their batches in flight (at most
` + relayenv.DrainTimeout + `), the cleaners stop, and the process exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := relayenv.FromEnv()
			if err != nil {
				return fmt.Errorf("millwright relay: %w", err)
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
	})
}

// relayHooks are test hooks: ready receives the HTTP address once it
// listens; wrapPublisher wraps the transport's publisher.
type relayHooks struct {
	ready         chan<- string
	wrapPublisher func(message.Publisher) message.Publisher
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
	db     *sql.DB
	schema string
	tr     *transport.Transport
	reg    *prometheus.Registry
	h      *health.Handler
	relays []*outbox.Relay
	comps  []component
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
	if err := p.openTransport(ctx, tcfg, hooks.wrapPublisher); err != nil {
		return err
	}
	if err := p.components(tables); err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s=%s: %w", relayenv.Addr, cfg.Addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(relayenv.PathMetrics, promhttp.HandlerFor(p.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.Handle(health.PathLive, p.h.Live())
	mux.Handle(health.PathReady, p.h.Ready())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	srvErr := make(chan error, 1)
	go func() { srvErr <- srv.Serve(ln) }()

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
	shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	var published uint64
	for _, r := range p.relays {
		published += r.Stats().Published
	}
	logf("drained in %s (%d events published since start)", time.Since(start).Round(time.Millisecond), published)
	return runErr
}

// openDB opens and checks the database; it reports which of the tables the
// retention cleaners clean the schema has (beside the outbox, required).
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
	names := []string{"millwright_outbox", "millwright_processed_events", "millwright_dead_letters", "millwright_saga_instances", "millwright_audit"}
	present := make([]bool, len(names))
	dest := []any{&p.schema}
	for i := range present {
		dest = append(dest, &present[i])
	}
	if err := p.db.QueryRowContext(ctx, `SELECT current_schema(), `+
		`to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL, to_regclass($4) IS NOT NULL, to_regclass($5) IS NOT NULL`,
		names[0], names[1], names[2], names[3], names[4]).Scan(dest...); err != nil {
		return nil, fmt.Errorf("reading the schema of %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	tables = make(map[string]bool, len(names))
	for i, n := range names {
		tables[n] = present[i]
	}
	if !tables["millwright_outbox"] {
		return nil, fmt.Errorf("no millwright_outbox in the search_path of %s (schema %q): run `millwright migrate` on that URL, or set search_path in %s to the service's schema",
			redact.URL(u), p.schema, relayenv.DatabaseURL)
	}
	return tables, nil
}

// openTransport opens the transport and the health checks of the database
// and the broker.
func (p *relayProcess) openTransport(ctx context.Context, tcfg transport.Config, wrap func(message.Publisher) message.Publisher) error {
	if tcfg.Kind == transport.SQL && (tcfg.SQL.URL == "" || tcfg.SQL.URL == p.cfg.DatabaseURL) {
		tcfg.SQL.URL, tcfg.SQL.DB = "", p.db // one pool: the relay publishes in the database
	}
	tcfg.Logger = p.logger
	tr, err := transport.Open(ctx, tcfg)
	if err != nil {
		return err
	}
	p.tr = tr
	if p.h, err = health.NewHandler(health.Config{}); err != nil {
		return err
	}
	p.h.Add("database", health.Ping(p.db))
	p.h.Add("broker", brokerCheck(tcfg, p.db))
	p.reg = prometheus.NewRegistry()
	p.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	pub := tr.Publisher()
	if wrap != nil {
		pub = wrap(pub)
	}
	listenURL := ""
	if p.cfg.Listen {
		listenURL = p.cfg.DatabaseURL
	}
	for i := range p.cfg.Relays {
		r, err := outbox.NewRelay(p.db, pub, outbox.RelayConfig{
			BatchSize: p.cfg.BatchSize, Workers: p.cfg.Workers, PollInterval: p.cfg.PollInterval, ListenURL: listenURL,
			DeadLetterTopic: p.cfg.DeadLetterTopic, CloseTimeout: p.cfg.DrainTimeout,
			Registerer: p.reg, Logger: p.logger,
		})
		if err != nil {
			return err
		}
		p.relays = append(p.relays, r)
		p.h.Add(fmt.Sprintf("relay-%d", i), health.Relay(r, p.cfg.ReadyMaxAge))
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
		open             func(*sql.DB, cleaner.Config) (*cleaner.Cleaner, error)
	}{
		{"outbox cleaner", relayenv.OutboxRetention, "millwright_outbox", p.cfg.OutboxRetention, outbox.NewCleaner},
		{"idempotency cleaner", relayenv.IdempotencyRetention, "millwright_processed_events", p.cfg.IdempotencyRetention, idempotency.NewCleaner},
		{"dead-letter cleaner", relayenv.DLQRetention, "millwright_dead_letters", p.cfg.DLQRetention, dlq.NewCleaner},
		{"saga cleaner", relayenv.SagaRetention, "millwright_saga_instances", p.cfg.SagaRetention, saga.NewCleaner},
		{"audit cleaner", relayenv.AuditRetention, "millwright_audit", p.cfg.AuditRetention, audit.NewCleaner},
	}
	for _, c := range cleaners {
		if c.retention <= 0 || !tables[c.table] {
			continue
		}
		cl, err := c.open(p.db, cleaner.Config{Retention: c.retention, Interval: p.cfg.CleanInterval, Logger: p.logger})
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
}

// brokerCheck is the broker part of readiness: a TCP connection to the
// broker's address succeeds (kafka: any bootstrap broker; amqp: the URL's
// host; googlecloud: the emulator or pubsub.googleapis.com), or, for the
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
