package millwright

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/tracing"
	"github.com/millwright/millwright/transport"
)

// ErrRunning is returned (wrapped) by the registration methods after Run
// has started, and by a second Run: register everything first, then Run
// once.
var ErrRunning = errors.New("millwright: the client already runs")

// Client is one service's millwright: the handlers, sagas and events it
// registers, and Run, which starts everything they need. Build it with
// NewClient. Its methods are safe for concurrent use.
type Client struct {
	db     postgres.DB
	cfg    Config
	wlog   watermill.LoggerAdapter
	health *health.Handler
	start  *health.Waiter // readiness until Run has started everything

	// hard ends the handlers' detached contexts: Grace minus graceMargin
	// after shutdown began.
	hard     context.Context
	hardStop context.CancelFunc

	// writer is the outbox Writer of Add: the default limits until Run
	// opens the transport, then that transport's.
	writer  atomic.Pointer[outbox.Writer]
	mu      sync.Mutex
	started bool
	routes  []route
	parts   []part // long-running components besides the router, in start order
	names   map[string]bool
	cancel  context.CancelFunc
	running chan struct{}
	done    chan struct{}
	tr      *transport.Transport

	stopping atomic.Bool   // Run is stopping: components returning is expected
	draining chan struct{} // closed when Run begins to stop
	slots    chan struct{} // one per handler running (Config.MaxHandlers)
}

// route is a registered handler.
type route struct {
	name, topic, group string
	handle             message.NoPublishHandlerFunc
	idempotent         bool
	inside             []message.HandlerMiddleware
}

// part is a long-running component Run starts after the router.
type part struct {
	name    string
	run     func(context.Context) error
	running <-chan struct{}
	close   func() error
}

// NewClient returns a client of the service whose database is db (with
// millwright's migrations applied, or Config.Migrate set) configured by
// cfg. It checks cfg (Validate, after the defaults) and connects to
// nothing: Run does.
func NewClient(db postgres.DB, cfg Config) (*Client, error) {
	if err := db.Valid(); err != nil {
		return nil, fmt.Errorf("millwright: NewClient: %w", err)
	}
	cfg.setDefaults(db)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.DatabaseURL == "" && db.Pgx() != nil {
		cfg.DatabaseURL = db.Pgx().Config().ConnString()
	}
	h, err := health.NewHandler(health.Config{})
	if err != nil {
		return nil, err
	}
	c := &Client{db: db, cfg: cfg, wlog: watermill.NewSlogLogger(cfg.Logger), health: h, start: health.Waiting("the client to start"),
		names: map[string]bool{}, running: make(chan struct{}), done: make(chan struct{}),
		draining: make(chan struct{}), slots: make(chan struct{}, cfg.MaxHandlers)}
	c.hard, c.hardStop = context.WithCancel(context.Background())
	h.Add("start", c.start)
	h.Add("database", health.Ping(db))
	w, err := outbox.NewWriter(outbox.WriterConfig{Source: "/" + cfg.Name})
	if err != nil {
		return nil, fmt.Errorf("millwright: the outbox writer: %w", err)
	}
	c.writer.Store(w)
	if t := cfg.Relay.DeadLetterTopic; t != "" && !cfg.NoRelay {
		// The relay's dead letters (events past their retry budget) are
		// recorded beside the handlers'. Record is idempotent.
		store := dlq.NewStore(db)
		if err := c.addRoute(route{name: "relay-dead-letters", topic: t, handle: store.Record}); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// HandlerFunc handles one message. With idempotency (the default) tx is
// the transaction that records the message's event id: write the
// handler's effects and its events (Client.Add) in it, and they commit
// once, with the mark, however often the message is delivered. A
// returned error is retried (Config.Retry in place, then Config.Park),
// then dead-lettered; failure.Permanent(err) dead-letters at once.
type HandlerFunc func(ctx context.Context, tx postgres.Tx, msg *message.Message) error

// HandlerConfig configures one handler. The zero value is the default.
type HandlerConfig struct {
	// Group is the consumer group. Default Config.Name + "." + the
	// handler's name.
	Group string
	// AtLeastOnce runs the handler without idempotency: its tx is the
	// zero postgres.Tx, and a redelivered message runs it again. Default
	// false.
	AtLeastOnce bool
	// Inside are extra middlewares, outermost first, run inside the
	// in-place retry and outside idempotency (so every attempt, and every
	// copy, is deduplicated): Watermill's Duplicator in a demo, a
	// service's own metrics. Default none.
	Inside []message.HandlerMiddleware
}

// Handle registers handler name on topic, behind the framework's
// middlewares, outermost first: tracing (the span continues the
// message's trace), park (a key still failing after the in-place retry
// is parked and retried later; its later messages wait behind it, other
// keys go on; after Config.Park it is dead-lettered to
// millwright_dead_letters, the one route of a poison message), the
// in-place retry (Config.Retry), idempotency (the handler runs in the
// transaction that records the event id), then h. Names are unique per
// client: letters, digits, '.', '_' and '-'.
func (c *Client) Handle(name, topic string, h HandlerFunc, cfg HandlerConfig) error {
	idem := !cfg.AtLeastOnce
	return c.addRoute(route{name: name, topic: topic, group: cfg.Group, idempotent: idem, inside: cfg.Inside, handle: func(msg *message.Message) error {
		var tx postgres.Tx
		if idem {
			var ok bool
			if tx, ok = idempotency.TxFromContext(msg.Context()); !ok {
				return failure.Permanent(fmt.Errorf("millwright: handler %s: no idempotency transaction in the message's context", name))
			}
		}
		return h(msg.Context(), tx, msg)
	}})
}

func (c *Client) addRoute(r route) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.started {
		return fmt.Errorf("%w: register handler %q before Run", ErrRunning, r.name)
	}
	switch {
	case r.name == "" || !serviceName.MatchString(r.name):
		return fmt.Errorf("millwright: handler name %q: want letters, digits, '.', '_' or '-', starting with a letter", r.name)
	case c.names[r.name]:
		return fmt.Errorf("millwright: handler %q is registered twice: give each handler its own name", r.name)
	case r.topic == "":
		return fmt.Errorf("millwright: handler %q: topic is empty", r.name)
	case r.handle == nil:
		return fmt.Errorf("millwright: handler %q: the handler func is nil", r.name)
	}
	if r.group == "" {
		r.group = c.cfg.Name + "." + r.name
	}
	c.names[r.name] = true
	c.routes = append(c.routes, r)
	return nil
}

func (c *Client) addPart(p part) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.started {
		return fmt.Errorf("%w: add %s before Run", ErrRunning, p.name)
	}
	c.parts = append(c.parts, p)
	return nil
}

// Add writes events to the outbox in tx, the caller's transaction (the
// business transaction, or a handler's): they are published by the
// relay once tx commits, and never if it rolls back. An event without a
// Source gets "/" + Config.Name.
func (c *Client) Add(ctx context.Context, tx postgres.Tx, events ...outbox.Event) error {
	if err := tx.Valid(); err != nil {
		return fmt.Errorf("millwright: Add: %w", err)
	}
	return c.writer.Load().Add(ctx, tx, events...)
}

// Running is closed once Run has started everything: the handlers are
// subscribed, and the relay, orchestrators, retriers and cleaners run.
func (c *Client) Running() <-chan struct{} { return c.running }

// Transport returns the transport Run opened, nil before Running.
func (c *Client) Transport() *transport.Transport {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tr
}

// Close stops Run as if its context had ended (see Run) and waits for it
// to return. It is idempotent; before Run, a later Run returns
// ErrRunning at once.
func (c *Client) Close() error {
	c.mu.Lock()
	cancel, started := c.cancel, c.started
	c.started = true // a later Run returns ErrRunning
	c.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	if started && cancel != nil {
		<-c.done
	}
	return nil
}

// HealthHandler serves liveness at /healthz and readiness at /readyz:
// ready once Run has started everything, while the database answers, the
// router runs, the relay completes rounds and the orchestrators run; not
// ready from the moment shutdown begins.
func (c *Client) HealthHandler() http.Handler { return c.health }

// MetricsHandler serves Config.Registry in Prometheus' text format.
func (c *Client) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(c.cfg.Registry, promhttp.HandlerOpts{})
}

// Handler serves HealthHandler at /healthz and /readyz and
// MetricsHandler at /metrics.
func (c *Client) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(health.PathLive, c.health)
	mux.Handle(health.PathReady, c.health)
	mux.Handle("/metrics", c.MetricsHandler())
	return mux
}

// Run starts everything the service registered, in dependency order,
// and blocks until ctx ends (or Close): it waits for the database
// (bounded by Config.StartTimeout), applies the migrations
// (Config.Migrate), opens the transport (waiting for the broker),
// subscribes every handler behind the framework's middlewares and runs
// the router, then starts park's retriers, the saga orchestrators, the
// outbox relay and the cleaners.
//
// When ctx ends, readiness fails at once, the router stops taking
// messages and lets the handlers in flight finish (their contexts stay
// live until Config.Grace minus 2 s), the other components drain at the
// same time, and the transport closes last, after everything that
// publishes through it. Run returns nil when every handler finished
// within the grace, an error naming the failure otherwise (a component
// that stopped on its own stops the others, and Run returns its error).
func (c *Client) Run(ctx context.Context) (err error) {
	c.mu.Lock()
	if c.started {
		c.mu.Unlock()
		return fmt.Errorf("%w: Run is called once per client", ErrRunning)
	}
	c.started = true
	ctx, c.cancel = context.WithCancel(ctx)
	c.mu.Unlock()
	defer close(c.done)
	defer c.cancel()

	startCtx, cancelStart := ctx, context.CancelFunc(func() {})
	if c.cfg.StartTimeout > 0 {
		startCtx, cancelStart = context.WithTimeout(ctx, c.cfg.StartTimeout)
	}
	defer cancelStart()
	tr, router, err := c.open(ctx, startCtx)
	if err != nil {
		if ctx.Err() != nil && startCtx.Err() == ctx.Err() {
			return nil // stopped while starting: nothing ran
		}
		return err
	}
	defer func() { err = errors.Join(err, closeErr("transport", tr.Close())) }()

	// The components run on a context the signal does not end: Run stops
	// them itself, in order, and the handlers' messages keep theirs.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	var wg sync.WaitGroup
	failed := make(chan error, len(c.parts)+1)
	launch := func(name string, run func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := run(runCtx)
			switch {
			case c.stopping.Load():
				err = nil
			case err == nil || errors.Is(err, context.Canceled):
				err = fmt.Errorf("millwright: %s stopped on its own: see its log", name)
			default:
				err = fmt.Errorf("millwright: %s: %w", name, err)
			}
			failed <- err
		}()
	}
	launch("router", router.Run)
	stopErr := c.waitStarted(ctx, router.Running(), failed)
	for i := 0; stopErr == nil && i < len(c.parts); i++ {
		launch(c.parts[i].name, c.parts[i].run)
		stopErr = c.waitStarted(ctx, c.parts[i].running, failed)
	}
	if stopErr == nil {
		c.start.Done()
		close(c.running)
		c.cfg.Logger.Info("millwright: running", "service", c.cfg.Name, "transport", tr.String(), "handlers", len(c.routes))
		select {
		case <-ctx.Done():
		case stopErr = <-failed:
		}
	}
	return errors.Join(stopErr, c.stop(router, &wg, cancelRun))
}

// waitStarted waits for a component's running channel, ctx's end or a
// component's failure.
func (c *Client) waitStarted(ctx context.Context, running <-chan struct{}, failed <-chan error) error {
	select {
	case <-running:
		return nil
	case <-ctx.Done():
		return nil
	case err := <-failed:
		return err
	}
}

// stop drains the router and the other components, within Config.Grace.
func (c *Client) stop(router *message.Router, wg *sync.WaitGroup, cancelRun context.CancelFunc) error {
	c.stopping.Store(true)
	close(c.draining)
	c.health.Drain()
	began := time.Now()
	hard := time.AfterFunc(c.cfg.Grace-graceMargin, c.hardStop)
	defer hard.Stop()
	errs := make([]error, len(c.parts)+1)
	var closing sync.WaitGroup
	// The router first among equals: it stops taking messages at once.
	// The others drain beside it, latest started first.
	closing.Add(1)
	go func() {
		defer closing.Done()
		if err := router.Close(); err != nil {
			errs[0] = fmt.Errorf("millwright: handlers still in flight after %s (Config.Grace %s): their messages are redelivered: %w",
				time.Since(began).Round(time.Millisecond), c.cfg.Grace, err)
		}
	}()
	for i := len(c.parts) - 1; i >= 0; i-- {
		closing.Add(1)
		go func() {
			defer closing.Done()
			errs[i+1] = closeErr(c.parts[i].name, c.parts[i].close())
		}()
	}
	closing.Wait()
	cancelRun()
	wg.Wait()
	c.cfg.Logger.Info("millwright: stopped", "service", c.cfg.Name, "took", time.Since(began).Round(time.Millisecond).String())
	return errors.Join(errs...)
}

func closeErr(what string, err error) error {
	if err != nil {
		return fmt.Errorf("millwright: closing %s: %w", what, err)
	}
	return nil
}

// open waits for the database, migrates, opens the transport and builds
// the router with every handler and the components that need it. Waits
// end with startCtx (Config.StartTimeout); the transport is opened on
// ctx, Run's own, since a transport may keep the context it was opened
// with, and waits for its broker until startCtx's deadline.
func (c *Client) open(runCtx, ctx context.Context) (*transport.Transport, *message.Router, error) {
	err := c.untilReady(ctx, "reaching the database", func(ctx context.Context) error {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return c.db.PingContext(pctx)
	})
	if err != nil {
		return nil, nil, err
	}
	if c.cfg.Migrate {
		if err := c.migrate(runCtx, ctx); err != nil {
			return nil, nil, err
		}
	}
	tcfg, err := c.transportConfig()
	if err != nil {
		return nil, nil, err
	}
	broker := health.Waiting("the broker")
	c.health.Add("broker", broker)
	tcfg.OnWait = broker.Failed
	if d, ok := ctx.Deadline(); ok && tcfg.WaitForBroker == 0 {
		tcfg.WaitForBroker = max(time.Until(d), time.Millisecond)
	}
	tr, err := transport.Open(runCtx, tcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("millwright: opening the transport: %w", err)
	}
	broker.Done()
	// Add refuses at write time what this transport would refuse.
	w, err := outbox.NewWriter(outbox.WriterConfig{Limits: tr.Limits(), Source: "/" + c.cfg.Name})
	if err != nil {
		return nil, nil, fmt.Errorf("millwright: the outbox writer of the transport: %w", err)
	}
	c.writer.Store(w)
	c.mu.Lock()
	c.tr = tr
	c.mu.Unlock()
	router, err := c.router(ctx, tr)
	if err == nil {
		err = c.components(tr)
	}
	if err != nil {
		_ = tr.Close()
		return nil, nil, err
	}
	return tr, router, nil
}

// transportConfig is Config.Transport, the environment's, or sql on the
// database URL.
func (c *Client) transportConfig() (transport.Config, error) {
	tcfg := c.cfg.Transport
	var err error
	switch {
	case tcfg.Kind != "":
	case os.Getenv(transport.EnvTransport) != "":
		tcfg, err = transport.FromEnv()
	case c.cfg.DatabaseURL != "":
		tcfg, err = transport.ParseURL(c.cfg.DatabaseURL)
	default:
		err = fmt.Errorf("millwright: no transport: set Config.Transport, %s, or Config.DatabaseURL (the sql transport)", transport.EnvTransport)
	}
	if err != nil {
		return tcfg, err
	}
	if tcfg.Logger == nil {
		tcfg.Logger = c.wlog
	}
	if kp := c.cfg.KeyParallelism; kp > 0 {
		if tcfg.Kind == transport.Kafka && tcfg.Kafka.KeyParallelism == 0 {
			tcfg.Kafka.KeyParallelism = kp
		}
		if tcfg.Kind == transport.AMQP && tcfg.AMQP.KeyParallelism == 0 {
			tcfg.AMQP.KeyParallelism = kp
		}
		if tcfg.Kind == transport.NATS && tcfg.NATS.KeyParallelism == 0 {
			tcfg.NATS.KeyParallelism = kp
		}
	}
	return tcfg, nil
}

// migrate applies millwright's migrations and the service's. A
// migration in progress runs on Run's context: StartTimeout (startCtx)
// bounds the waits between attempts, not a long migration.
func (c *Client) migrate(runCtx, startCtx context.Context) error {
	sources := append(migrations.All(), c.cfg.Migrations...)
	return c.untilReady(startCtx, "migrating the database", func(context.Context) error {
		_, err := migrate.Up(runCtx, c.db, sources...)
		if err != nil && errors.Is(err, migrate.ErrNoSchema) {
			return failure.Permanent(err)
		}
		return err
	})
}

// startupRetry paces untilReady: a database or broker that drops while
// the service starts is waited for, not fatal.
var startupRetry = retry.Policy{InitialInterval: 200 * time.Millisecond, MaxInterval: 5 * time.Second, MaxAttempts: -1}.WithDefaults()

// untilReady runs step until it succeeds, a permanent error, or ctx's end
// (Config.StartTimeout), logging each failure with what it waits for.
func (c *Client) untilReady(ctx context.Context, what string, step func(context.Context) error) error {
	for attempt := 1; ; attempt++ {
		err := step(ctx)
		if err == nil || failure.IsPermanent(err) {
			if err != nil {
				err = fmt.Errorf("millwright: %s: %w", what, err)
			}
			return err
		}
		delay := startupRetry.Backoff(attempt)
		c.cfg.Logger.Error("millwright: startup step failed; retrying", "step", what, "attempt", attempt, "retry_in", delay.String(), "error", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("millwright: %s: gave up after %d attempts (Config.StartTimeout %s): %w", what, attempt, c.cfg.StartTimeout, err)
		case <-time.After(delay):
		}
	}
}

// router subscribes every handler behind the framework's middlewares.
func (c *Client) router(ctx context.Context, tr *transport.Transport) (*message.Router, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: c.cfg.Grace - graceMargin}, c.wlog)
	if err != nil {
		return nil, err
	}
	rm, err := retry.NewMiddleware(retry.Config{Policy: c.cfg.Retry, Logger: c.wlog, Registerer: c.cfg.Registry, SilentGiveUp: true})
	if err != nil {
		return nil, err
	}
	for _, r := range c.routes {
		sub, err := tr.Subscriber(r.group)
		if err != nil {
			return nil, fmt.Errorf("millwright: handler %s: %w", r.name, err)
		}
		if si, ok := sub.(message.SubscribeInitializer); ok {
			err := c.untilReady(ctx, "creating topic "+r.topic+" for handler "+r.name, func(context.Context) error { return si.SubscribeInitialize(r.topic) })
			if err != nil {
				return nil, err
			}
		}
		parker, err := park.New(c.db, c.parkConfig(r.group))
		if err != nil {
			return nil, fmt.Errorf("millwright: handler %s: %w", r.name, err)
		}
		mws := append([]message.HandlerMiddleware{c.admit, shutdown.Middleware, tracing.Middleware(tracing.Config{}), parker.Middleware(r.name), rm.Middleware}, r.inside...)
		if r.idempotent {
			idem, err := c.idempotency(r.group)
			if err != nil {
				return nil, fmt.Errorf("millwright: handler %s: %w", r.name, err)
			}
			mws = append(mws, idem.Middleware)
		}
		router.AddConsumerHandler(r.name, r.topic, sub, r.handle).AddMiddleware(mws...)
		// The retrier runs the handlers park's middleware registered:
		// it starts after the router has applied them.
		c.parts = append([]part{{name: "park retrier of " + r.name, run: parker.Run, running: parker.Running(), close: parker.Close}}, c.parts...)
	}
	c.health.Add("router", health.Router(router))
	return router, nil
}

func (c *Client) parkConfig(group string) park.Config {
	return park.Config{Retry: c.cfg.Park, OnDeadLetter: c.cfg.OnDeadLetter, ConsumerGroup: group, Logger: c.wlog, Registerer: c.cfg.Registry}
}

func (c *Client) idempotency(consumer string) (*idempotency.Middleware, error) {
	store, err := idempotency.NewPostgresStore(c.db)
	if err != nil {
		return nil, err
	}
	return idempotency.NewMiddleware(store, idempotency.Config{Consumer: consumer, Registerer: c.cfg.Registry, Logger: c.wlog})
}

// errDraining nacks a message that was still waiting for a handler slot
// when shutdown began.
var errDraining = errors.New("millwright: shutting down: not started, the broker redelivers it")

// admit runs a message's handler once one of Config.MaxHandlers slots is
// free, with a context that keeps the message's values but not its
// cancellation: a subscriber closed at shutdown ends its messages'
// contexts at once, which would roll back the handlers in flight. Theirs
// ends Grace minus graceMargin after shutdown began. A message still
// waiting for a slot then is nacked, never started. The message's own
// context is restored on return.
func (c *Client) admit(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		select {
		case <-c.draining:
			return nil, errDraining
		default:
		}
		select {
		case c.slots <- struct{}{}:
		case <-c.draining:
			return nil, errDraining
		}
		defer func() { <-c.slots }()
		orig := msg.Context()
		ctx, cancel := context.WithCancel(context.WithoutCancel(orig))
		unhook := context.AfterFunc(c.hard, cancel)
		defer func() {
			unhook()
			cancel()
			msg.SetContext(orig)
		}()
		msg.SetContext(ctx)
		return h(msg)
	}
}
