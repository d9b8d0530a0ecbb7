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

// runRelay runs until ctx ends (the signal), then drains.
func runRelay(ctx context.Context, cfg relayenv.Config, tcfg transport.Config, logOut io.Writer, hooks *relayHooks) error {
	if hooks == nil {
		hooks = &relayHooks{}
	}
	logger := watermill.NewStdLoggerWithOut(logOut, false, false)
	logf := func(format string, args ...any) { fmt.Fprintf(logOut, "millwright relay: "+format+"\n", args...) }

	db, err := pgconn.Open(cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("opening database %s: %w", redactURL(cfg.DatabaseURL), redact.Error(err))
	}
	defer db.Close()
	db.SetMaxOpenConns(cfg.MaxConns)
	db.SetMaxIdleConns(cfg.MaxConns)
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("connecting to database %s: %w", redactURL(cfg.DatabaseURL), redact.Error(err))
	}
	var schema string
	var hasOutbox, hasProcessed bool
	if err := db.QueryRowContext(ctx, `SELECT current_schema(), to_regclass('millwright_outbox') IS NOT NULL, to_regclass('millwright_processed_events') IS NOT NULL`).
		Scan(&schema, &hasOutbox, &hasProcessed); err != nil {
		return fmt.Errorf("reading the schema of %s: %w", redactURL(cfg.DatabaseURL), redact.Error(err))
	}
	if !hasOutbox {
		return fmt.Errorf("no millwright_outbox in the search_path of %s (schema %q): run `millwright migrate` on that URL, or set search_path in %s to the service's schema",
			redactURL(cfg.DatabaseURL), schema, relayenv.DatabaseURL)
	}

	if tcfg.Kind == transport.SQL && (tcfg.SQL.URL == "" || tcfg.SQL.URL == cfg.DatabaseURL) {
		tcfg.SQL.URL, tcfg.SQL.DB = "", db // one pool: the relay publishes in the database
	}
	tcfg.Logger = logger
	tr, err := transport.Open(ctx, tcfg)
	if err != nil {
		return err
	}
	defer tr.Close()
	pub := tr.Publisher()
	if hooks.wrapPublisher != nil {
		pub = hooks.wrapPublisher(pub)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h, err := health.NewHandler(health.Config{})
	if err != nil {
		return err
	}
	h.Add("database", health.Ping(db))
	h.Add("broker", brokerCheck(tcfg, db))

	listenURL := ""
	if cfg.Listen {
		listenURL = cfg.DatabaseURL
	}
	relays := make([]*outbox.Relay, cfg.Relays)
	for i := range relays {
		r, err := outbox.NewRelay(db, pub, outbox.RelayConfig{
			BatchSize: cfg.BatchSize, PollInterval: cfg.PollInterval, ListenURL: listenURL,
			DeadLetterTopic: cfg.DeadLetterTopic, CloseTimeout: cfg.DrainTimeout,
			Registerer: reg, Logger: logger,
		})
		if err != nil {
			return err
		}
		relays[i] = r
		h.Add(fmt.Sprintf("relay-%d", i), health.Relay(r, cfg.ReadyMaxAge))
	}
	// Where retention cleaners plug in: each is a Run/Close component on db.
	type component struct {
		name  string
		run   func(context.Context) error
		close func() error
	}
	var comps []component
	for i, r := range relays {
		comps = append(comps, component{fmt.Sprintf("relay-%d", i), r.Run, r.Close})
	}
	if cfg.OutboxRetention > 0 {
		c, err := outbox.NewCleaner(db, outbox.CleanerConfig{Retention: cfg.OutboxRetention, Interval: cfg.CleanInterval, Logger: logger})
		if err != nil {
			return fmt.Errorf("%s: %w", relayenv.OutboxRetention, err)
		}
		comps = append(comps, component{"outbox cleaner", c.Run, c.Close})
	}
	if cfg.IdempotencyRetention > 0 && hasProcessed {
		c, err := idempotency.NewCleaner(db, idempotency.CleanerConfig{Retention: cfg.IdempotencyRetention, Interval: cfg.CleanInterval, Logger: logger})
		if err != nil {
			return fmt.Errorf("%s: %w", relayenv.IdempotencyRetention, err)
		}
		comps = append(comps, component{"idempotency cleaner", c.Run, c.Close})
	}

	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s=%s: %w", relayenv.Addr, cfg.Addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(relayenv.PathMetrics, promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.Handle(health.PathLive, h.Live())
	mux.Handle(health.PathReady, h.Ready())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	srvErr := make(chan error, 1)
	go func() { srvErr <- srv.Serve(ln) }()

	// Components run on a context the signal does not cancel: the signal
	// starts Close, which lets batches in flight finish.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	var wg sync.WaitGroup
	failed := make(chan error, len(comps))
	for _, c := range comps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.run(runCtx); err != nil {
				failed <- fmt.Errorf("%s: %w", c.name, err)
			}
		}()
	}
	logf("%d relay(s) on %s (schema %s), transport %s, serving %s, %s and %s on %s",
		len(relays), redactURL(cfg.DatabaseURL), schema, tr, relayenv.PathMetrics, health.PathLive, health.PathReady, ln.Addr())
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
	h.Drain()
	var closing sync.WaitGroup
	for _, c := range comps {
		closing.Add(1)
		go func() {
			defer closing.Done()
			_ = c.close() // relays: at most DrainTimeout, then cancelled
		}()
	}
	closed := make(chan struct{})
	go func() { closing.Wait(); wg.Wait(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(cfg.DrainTimeout + time.Second):
		cancelRun() // a cleaner's batch or a slow publish: abandon it
		select {
		case <-closed:
		case <-time.After(2 * time.Second):
			// A publish that does not hear its context: leave it; its rows
			// stay leased and are republished after the lease.
			runErr = errors.Join(runErr, fmt.Errorf("drain: a relay or cleaner still runs %s after the signal (a publish that ignores its context?); exiting without it: its rows are republished after the lease", time.Since(start).Round(time.Millisecond)))
		}
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	var published uint64
	for _, r := range relays {
		published += r.Stats().Published
	}
	logf("drained in %s (%d events published since start)", time.Since(start).Round(time.Millisecond), published)
	return runErr
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
