package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/metrics"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/tracing"
)

// App is the order example: the services of one process, sharing one
// database pool, transport and metrics registry.
type App struct {
	cfg    Config
	db     db
	topics Topics
	orch   *saga.Orchestrator[Fulfilment]
	store  *dlq.Store
	// writer checks events against the transport's limits.
	writer *outbox.Writer
	// The constructors of millwright's components are generic over the
	// pool (postgres.Pool): wire builds them on Config's pool.
	newIdempotencyStore func() (*idempotency.PostgresStore, error)
	newRelay            func(message.Publisher, relay.Config) (*relay.Relay, error)
	newCleaners         func(retention.Config) ([]*retention.Cleaner, error)

	newParker func(park.Config) (*park.Parker, error)

	mu      sync.Mutex
	subs    map[string]message.Subscriber
	parkers map[string]*park.Parker // by consumer group, with Config.Park
}

// New validates cfg and builds the example's components. It registers the
// saga and dead-letter metrics on cfg.Registerer; the others register when
// Run starts them.
func New(cfg Config) (*App, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	a := &App{cfg: cfg, topics: NewTopics(cfg.TopicPrefix), subs: map[string]message.Subscriber{}, parkers: map[string]*park.Parker{}}
	var err error
	// Events are refused at write time when this transport would refuse
	// them (its names, its message size on the wire).
	if a.writer, err = outbox.NewWriter(outbox.WriterConfig{Limits: cfg.Transport.Limits()}); err != nil {
		return nil, err
	}
	if cfg.Pgx != nil {
		a.db = pgxDB{cfg.Pgx}
		err = wire(a, cfg.Pgx)
	} else {
		a.db = sqlDB{cfg.DB}
		err = wire(a, cfg.DB)
	}
	if err != nil {
		return nil, err
	}
	if _, err := metrics.Register(cfg.Registerer, dlq.NewDepthCollector(a.store)); err != nil {
		return nil, fmt.Errorf("orders: registering the dead-letter depth gauge: %w", err)
	}
	return a, nil
}

// wire builds the saga orchestrator, the dead-letter store and the
// constructors of the other components on pool, a *pgxpool.Pool or a
// *sql.DB: the same calls on either driver.
func wire[P postgres.Pool](a *App, pool P) error {
	v1, v2, err := a.definitions()
	if err != nil {
		return err
	}
	// New orders start on Config.SagaVersion; the other version stays
	// registered, so that its running orders finish by its own steps.
	def, other := v2, v1
	if a.cfg.SagaVersion == 1 {
		def, other = v1, v2
	}
	a.orch, err = saga.NewOrchestrator(postgres.From(pool), def, saga.Config{
		ReplyTopic: a.topics.Replies, PollInterval: a.cfg.SagaPollInterval, Source: "examples/orders/orchestrator",
		Registerer: a.cfg.Registerer, Logger: a.cfg.Logger, Versions: []saga.Versioned{other},
	})
	if err != nil {
		return err
	}
	a.store = dlq.NewStore(postgres.From(pool))
	a.newParker = func(cfg park.Config) (*park.Parker, error) { return park.New(postgres.From(pool), cfg) }
	a.newIdempotencyStore = func() (*idempotency.PostgresStore, error) { return idempotency.NewPostgresStore(postgres.From(pool)) }
	a.newRelay = func(pub message.Publisher, cfg relay.Config) (*relay.Relay, error) {
		return relay.New(postgres.From(pool), pub, cfg)
	}
	// Retention, each table at its default (package retention): published
	// outbox rows and processed-event marks (7 days), finished sagas (30
	// days), dead letters (90 days). One cleaner of each per schema works
	// at a time, whatever the number of relay processes.
	a.newCleaners = func(cfg retention.Config) ([]*retention.Cleaner, error) {
		var cs []*retention.Cleaner
		for _, open := range []func(postgres.DB, retention.Config) (*retention.Cleaner, error){
			retention.NewOutboxCleaner, retention.NewIdempotencyCleaner, retention.NewSagaCleaner, retention.NewDeadLetterCleaner,
		} {
			c, err := open(postgres.From(pool), cfg)
			if err != nil {
				return nil, err
			}
			cs = append(cs, c)
		}
		return cs, nil
	}
	return nil
}

// Topics returns the example's topic names.
func (a *App) Topics() Topics { return a.topics }

// MetricsHandler serves every metric registered on Config.Registerer when it
// is a prometheus.Gatherer (the default registry is), else the default
// gatherer.
func (a *App) MetricsHandler() http.Handler {
	g, ok := a.cfg.Registerer.(prometheus.Gatherer)
	if !ok {
		g = prometheus.DefaultGatherer
	}
	return promhttp.HandlerFor(g, promhttp.HandlerOpts{})
}

// Seed sets the stock of each SKU to at least the given quantity (a SKU
// already stocked keeps its stock).
func (a *App) Seed(ctx context.Context, stock map[string]int64) error {
	for sku, n := range stock {
		if err := a.db.exec(ctx, `INSERT INTO orders_stock (sku, initial, available) VALUES ($1, $2, $2) ON CONFLICT (sku) DO NOTHING`, sku, n); err != nil {
			return fmt.Errorf("seeding stock of %s (did the migrations run?): %w", sku, err)
		}
	}
	return nil
}

func (a *App) subscriber(group string) (message.Subscriber, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if s, ok := a.subs[group]; ok {
		return s, nil
	}
	s, err := a.cfg.Transport.Subscriber(group)
	if err != nil {
		return nil, fmt.Errorf("orders: subscriber for group %q: %w", group, err)
	}
	a.subs[group] = s
	return s, nil
}

// consumer adds a handler with the full reliability stack: recover, retry
// and dead-letter outermost, optionally Duplicator, then the idempotency
// middleware that runs h in the transaction recording the event id.
func (a *App) consumer(ctx context.Context, r *message.Router, name, topic, group string, h message.NoPublishHandlerFunc) error {
	var sub message.Subscriber
	err := a.untilReady(ctx, "subscribing "+name+" to "+topic, func() error {
		var err error
		if sub, err = a.subscriber(group); err != nil {
			return err
		}
		if si, ok := sub.(message.SubscribeInitializer); ok {
			if err := si.SubscribeInitialize(topic); err != nil {
				return fmt.Errorf("orders: initializing topic %s for %s: %w", topic, name, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	store, err := a.newIdempotencyStore()
	if err != nil {
		return err
	}
	idem, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: name, Registerer: a.cfg.Registerer, Logger: a.cfg.Logger})
	if err != nil {
		return err
	}
	// Tracing outermost: the handle span continues the trace the message
	// carries, and the handler's outbox writes carry it on.
	mws := []message.HandlerMiddleware{tracing.Middleware(tracing.Config{})}
	if a.cfg.Park {
		parked, err := a.parkMiddlewares(name, group)
		if err != nil {
			return err
		}
		mws = append(mws, parked...)
	} else {
		dead, err := dlq.NewMiddleware(a.cfg.Transport.Publisher(), dlq.Config{ConsumerGroup: group, Retry: a.cfg.ConsumerRetry,
			Registerer: a.cfg.Registerer, Logger: a.cfg.Logger, MaxValueBytes: dlq.DefaultMaxValueBytes})
		if err != nil {
			return err
		}
		mws = append(mws, dead.Middleware)
	}
	if a.cfg.Duplicate {
		mws = append(mws, middleware.Duplicator)
	}
	mws = append(mws, idem.Middleware)
	r.AddConsumerHandler(name, topic, sub, h).AddMiddleware(mws...)
	return nil
}

// parkMiddlewares returns, for Config.Park, the middlewares of consumer
// name in group, outermost first: park (its group's Parker), a short
// in-place retry, and a recoverer turning a handler's panic into an
// error (park then parks the message rather than the process dying).
func (a *App) parkMiddlewares(name, group string) ([]message.HandlerMiddleware, error) {
	a.mu.Lock()
	parker := a.parkers[group]
	if parker == nil {
		var err error
		parker, err = a.newParker(park.Config{ConsumerGroup: group, Retry: a.cfg.ParkRetry, Logger: a.cfg.Logger, Registerer: a.cfg.Registerer})
		if err != nil {
			a.mu.Unlock()
			return nil, fmt.Errorf("orders: parker of group %s: %w", group, err)
		}
		a.parkers[group] = parker
	}
	a.mu.Unlock()
	inPlace, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxAttempts: 3},
		Logger: a.cfg.Logger, Registerer: a.cfg.Registerer})
	if err != nil {
		return nil, err
	}
	return []message.HandlerMiddleware{parker.Middleware(name), inPlace.Middleware, middleware.Recoverer}, nil
}

// parkerLoops returns the retrier loop of every Parker not started yet;
// each waits for the router to run (its middlewares, which register the
// handlers the retrier runs, are applied then).
func (a *App) parkerLoops(router *message.Router, started map[*park.Parker]bool) []loop {
	a.mu.Lock()
	defer a.mu.Unlock()
	var loops []loop
	for _, p := range a.parkers {
		if started[p] {
			continue
		}
		started[p] = true
		loops = append(loops, loop{
			run: func(ctx context.Context) error {
				select {
				case <-router.Running():
				case <-ctx.Done():
					return nil
				}
				return p.Run(ctx)
			},
			running: p.Running(),
			close:   p.Close,
		})
	}
	return loops
}

// Run runs the given services (all of them when none is given) until ctx
// ends; see Start.
func (a *App) Run(ctx context.Context, services ...Service) error {
	p, err := a.Start(ctx, services...)
	if err != nil {
		return err
	}
	return p.Wait()
}

// Process is a set of services started by Start.
type Process struct {
	cancel  context.CancelFunc
	running chan struct{}
	done    chan struct{}
	err     error
}

// Running is closed once every consumer has subscribed and the relay and
// timeout loops have started.
func (p *Process) Running() <-chan struct{} { return p.running }

// Done is closed once the services have stopped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Wait blocks until the services have stopped and returns the first error
// that stopped them (nil after a clean stop).
func (p *Process) Wait() error { <-p.done; return p.err }

// Stop stops the services and waits for them (Wait).
func (p *Process) Stop() error { p.cancel(); return p.Wait() }

// Start starts the given services (all of them when none is given) in the
// background until ctx ends, Stop is called or one of them fails, which
// stops the others. Wait returns once the router's handlers have drained
// (up to 20 s: below shutdown.Service's 25 s grace, so the router gives up
// on a stuck handler, and says which, before the forced exit) and the relay, cleaners and timeout loop have returned:
// close the transport only after that, since the dead-letter middleware
// publishes through it (Watermill issue #446). The Orders service's HTTP
// API is served by Handler; Start only checks the database for it.
func (a *App) Start(ctx context.Context, services ...Service) (*Process, error) {
	if len(services) == 0 {
		services = AllServices
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, a.cfg.Logger)
	if err != nil {
		return nil, err
	}
	// A forced exit past the grace names the handlers it waited for.
	router.AddMiddleware(shutdown.Middleware)
	var (
		loops     []loop
		consumers int
	)
	for _, s := range services {
		l, c, err := a.startService(ctx, router, s)
		if err != nil {
			return nil, fmt.Errorf("orders: starting %s: %w", s, err)
		}
		loops, consumers = append(loops, l...), consumers+c
	}
	loops = append(loops, a.parkerLoops(router, map[*park.Parker]bool{})...)

	ctx, cancel := context.WithCancel(ctx)
	p := &Process{cancel: cancel, running: make(chan struct{}), done: make(chan struct{})}
	errc := make(chan error, len(loops)+2)
	for _, l := range loops {
		go func() { errc <- l.run(ctx) }()
	}
	// Services without a loop (the order service) run until ctx ends.
	go func() { <-ctx.Done(); errc <- nil }()
	n := len(loops) + 1
	if consumers > 0 {
		go func() { errc <- router.Run(ctx) }()
		n++
	}
	go func() {
		defer close(p.done)
		for i := 0; i < n; i++ {
			if err := <-errc; err != nil && !errors.Is(err, context.Canceled) && p.err == nil {
				p.err = err
			}
			cancel()
		}
		_ = router.Close()
		for _, l := range loops {
			if err := l.close(); err != nil && p.err == nil {
				p.err = err
			}
		}
	}()
	go func() {
		if consumers > 0 {
			select {
			case <-router.Running():
			case <-p.done:
				return
			}
		}
		for _, l := range loops {
			select {
			case <-l.running:
			case <-p.done:
				return
			}
		}
		close(p.running)
	}()
	return p, nil
}

// loop is a component that runs until its context ends.
type loop struct {
	run     func(context.Context) error
	running <-chan struct{}
	close   func() error
}

// startService adds service s's consumers to r and returns its loops and
// the number of consumers it added.
func (a *App) startService(ctx context.Context, r *message.Router, s Service) (loops []loop, consumers int, err error) {
	switch s {
	case Orders:
		err = a.untilReady(ctx, "reaching the database", func() error { return a.db.ping(ctx) })
	case Inventory:
		err = a.consumer(ctx, r, "inventory", a.topics.InventoryCommands, GroupInventory,
			participant(a.writer, "inventory", validStock, reserve, release))
		consumers++
	case Billing:
		err = a.consumer(ctx, r, "billing", a.topics.BillingCommands, GroupBilling,
			participant(a.writer, "billing", validPayment, a.charge, refund))
		consumers++
	case Shipping:
		err = a.consumer(ctx, r, "shipping", a.topics.ShippingCommands, GroupShipping,
			participant(a.writer, "shipping", validShipment, schedule, cancelShipment))
		consumers++
	case Notify:
		err = a.consumer(ctx, r, "notify", a.topics.OrderEvents, GroupNotify, a.notify)
		consumers++
	case Orchestrator:
		err = errors.Join(
			a.consumer(ctx, r, "orchestrator.start", a.topics.OrderEvents, GroupOrchestrator, a.startSaga),
			a.consumer(ctx, r, "orchestrator.replies", a.topics.Replies, GroupOrchestrator, a.handleReply))
		loops = append(loops, loop{a.orch.Run, a.orch.Running(), a.orch.Close})
		consumers += 2
	case DeadLetters:
		err = a.recorders(ctx, r)
		consumers++
	case Relay:
		var rel *relay.Relay
		rel, err = a.NewRelay(a.cfg.Transport.Publisher())
		if err != nil {
			break
		}
		loops = append(loops, loop{rel.Run, rel.Running(), rel.Close})
		var cleaners []*retention.Cleaner
		if cleaners, err = a.newCleaners(retention.Config{Logger: a.cfg.Logger}); err != nil {
			break
		}
		for _, c := range cleaners {
			loops = append(loops, loop{c.Run, c.Running(), c.Close})
		}
	default:
		err = fmt.Errorf("unknown service %q", s)
	}
	return loops, consumers, err
}

// NewRelay returns an outbox relay configured like the one Run starts,
// publishing through pub (wrapped by Config.RelayPublisher when set).
func (a *App) NewRelay(pub message.Publisher) (*relay.Relay, error) {
	if a.cfg.RelayPublisher != nil {
		pub = a.cfg.RelayPublisher(pub)
	}
	return a.newRelay(pub, relay.Config{
		ListenURL: a.cfg.DatabaseURL, Lease: a.cfg.RelayLease, Retry: a.cfg.RelayRetry,
		Registerer: a.cfg.Registerer, MetricsInterval: time.Second, Logger: a.cfg.Logger,
	})
}

// recorders store the dead letters of every topic in millwright_dead_letters.
func (a *App) recorders(ctx context.Context, r *message.Router) error {
	for _, t := range a.topics.All() {
		dt := dlq.DefaultTopic(t)
		var sub message.Subscriber
		err := a.untilReady(ctx, "subscribing the dead-letter recorder to "+dt, func() error {
			var err error
			if sub, err = a.subscriber(GroupDeadLetters); err != nil {
				return err
			}
			if si, ok := sub.(message.SubscribeInitializer); ok {
				if err := si.SubscribeInitialize(dt); err != nil {
					return fmt.Errorf("initializing dead-letter topic %s: %w", dt, err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		r.AddConsumerHandler("dlq-recorder."+t, dt, sub, a.store.Record)
	}
	return nil
}

// startupRetry paces untilReady: a broker or database that drops while a
// service starts (a restart, a failover) is waited for, not fatal.
var startupRetry = retry.Policy{InitialInterval: 200 * time.Millisecond, MaxInterval: 5 * time.Second, MaxAttempts: -1}

// untilReady runs step until it succeeds, backing off between attempts
// and logging each failure with what was being done, until ctx ends; it
// then returns the last failure with ctx's error. A permanent error
// (failure.Permanent) is returned at once.
func (a *App) untilReady(ctx context.Context, what string, step func() error) error {
	p := startupRetry.WithDefaults()
	for attempt := 1; ; attempt++ {
		err := step()
		if err == nil {
			if attempt > 1 {
				a.cfg.Logger.Info("Startup step succeeded after retrying", watermill.LogFields{"step": what, "attempts": attempt})
			}
			return nil
		}
		if failure.IsPermanent(err) {
			return err
		}
		delay := p.Backoff(attempt)
		a.cfg.Logger.Error("Startup step failed; retrying", err, watermill.LogFields{"step": what, "attempt": attempt, "retry_in": delay.String()})
		select {
		case <-ctx.Done():
			return fmt.Errorf("orders: %s: gave up after %d attempts (%w): %w", what, attempt, ctx.Err(), err)
		case <-time.After(delay):
		}
	}
}
