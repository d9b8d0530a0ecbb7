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

	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/interrupt"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/relayenv"
	"github.com/millwright/millwright/outbox"
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
	hasProcessed, err := p.openDB(ctx)
	if err != nil {
		return err
	}
	if err := p.openTransport(ctx, tcfg, hooks.wrapPublisher); err != nil {
		return err
	}
	if err := p.components(hasProcessed); err != nil {
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

// openDB opens and checks the database; it reports whether the schema has
// the idempotency table.
func (p *relayProcess) openDB(ctx context.Context) (hasProcessed bool, err error) {
	u := p.cfg.DatabaseURL
	if p.db, err = pgconn.Open(u); err != nil {
		return false, fmt.Errorf("opening database %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	p.db.SetMaxOpenConns(p.cfg.MaxConns)
	p.db.SetMaxIdleConns(p.cfg.MaxConns)
	if err := p.db.PingContext(ctx); err != nil {
		return false, fmt.Errorf("connecting to database %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	var hasOutbox bool
	if err := p.db.QueryRowContext(ctx, `SELECT current_schema(), to_regclass('millwright_outbox') IS NOT NULL, to_regclass('millwright_processed_events') IS NOT NULL`).
		Scan(&p.schema, &hasOutbox, &hasProcessed); err != nil {
		return false, fmt.Errorf("reading the schema of %s: %w", redact.URL(u), redact.ErrorOf(err, u))
	}
	if !hasOutbox {
		return false, fmt.Errorf("no millwright_outbox in the search_path of %s (schema %q): run `millwright migrate` on that URL, or set search_path in %s to the service's schema",
			redact.URL(u), p.schema, relayenv.DatabaseURL)
	}
	return hasProcessed, nil
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
			BatchSize: p.cfg.BatchSize, PollInterval: p.cfg.PollInterval, ListenURL: listenURL,
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

// components lists what runs: the relays, then the cleaners. A retention
// cleaner of another table (dead letters, sagas, audit) is one more
// component here, with its own MILLWRIGHT_*_RETENTION in relayenv.
func (p *relayProcess) components(hasProcessed bool) error {
	for i, r := range p.relays {
		p.comps = append(p.comps, component{fmt.Sprintf("relay-%d", i), r.Run, r.Close})
	}
	if p.cfg.OutboxRetention > 0 {
		c, err := outbox.NewCleaner(p.db, outbox.CleanerConfig{Retention: p.cfg.OutboxRetention, Interval: p.cfg.CleanInterval, Logger: p.logger})
		if err != nil {
			return fmt.Errorf("%s: %w", relayenv.OutboxRetention, err)
		}
		p.comps = append(p.comps, component{"outbox cleaner", c.Run, c.Close})
	}
	if p.cfg.IdempotencyRetention > 0 && hasProcessed {
		c, err := idempotency.NewCleaner(p.db, idempotency.CleanerConfig{Retention: p.cfg.IdempotencyRetention, Interval: p.cfg.CleanInterval, Logger: p.logger})
		if err != nil {
			return fmt.Errorf("%s: %w", relayenv.IdempotencyRetention, err)
		}
		p.comps = append(p.comps, component{"idempotency cleaner", c.Run, c.Close})
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
