package park

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// OnDeadLetter says what happens to a key's later messages once one of its
// messages was dead-lettered (its park budget spent, or a permanent error).
type OnDeadLetter string

const (
	// Hold keeps the key parked, its dead-lettered message at its head, so
	// that none of its later messages runs before the operator acts:
	// `millwright parked retry` (run the head again, then the rest) or
	// `millwright parked release` (drop the head, which stays in the DLQ,
	// and go on with the rest). Per-key order is never broken. The default.
	Hold OnDeadLetter = "hold"
	// Continue makes the key's next parked message due at once: the key
	// goes on without the dead-lettered message, which a replay from the
	// DLQ applies later, out of order.
	Continue OnDeadLetter = "continue"
)

// Metric names. The gauges come from NewCollector, the counters from a
// Parker with Config.Registerer.
const (
	// MetricParkedKeys is the number of parked keys, by handler.
	MetricParkedKeys = "millwright_park_parked_keys"
	// MetricParkedMessages is the number of parked messages, by handler.
	MetricParkedMessages = "millwright_park_parked_messages"
	// MetricHeldKeys is the number of keys held after a dead letter
	// (OnDeadLetter Hold), by handler: each waits for an operator.
	MetricHeldKeys = "millwright_park_held_keys"
	// MetricParked counts messages parked, by handler and cause
	// ("failed": its handler failed; "behind": its key was parked;
	// "replaced": a replayed dead letter took its parked message's place).
	MetricParked = "millwright_park_parked_total"
	// MetricRetries counts the retrier's rounds, by handler and outcome
	// ("ok", "failed", "dead_letter").
	MetricRetries = "millwright_park_retries_total"
	// MetricSetAside counts parked records the retrier could not handle,
	// by handler and cause ("handler_panic": a handler's panic no
	// middleware inside park recovered; "panic": elsewhere in the round,
	// Config.Publish or park; "bad_row": a row that does not decode):
	// each is held for an operator, its cause in the key's last error.
	MetricSetAside = "millwright_park_set_aside_total"
)

// DefaultKey is the default Config.Key: metadata.OrderingKey (the Kafka
// key and Pub/Sub ordering key the outbox sets to the aggregate), else
// metadata.AggregateType and AggregateID, else "" (no key).
func DefaultKey(msg *message.Message) string {
	if k := msg.Metadata.Get(metadata.OrderingKey); k != "" {
		return k
	}
	if id := msg.Metadata.Get(metadata.AggregateID); id != "" {
		return msg.Metadata.Get(metadata.AggregateType) + "/" + id
	}
	return ""
}

// DefaultPolicy is the park budget when Config.Retry is zero: 10 rounds of
// the retrier, 1 s doubling to 5 min with full jitter (about 15 minutes
// in all, before jitter).
var DefaultPolicy = retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: 5 * time.Minute, MaxAttempts: 10, Jitter: retry.JitterFull}

// Config configures a Parker. The zero value is usable.
type Config struct {
	// Retry is the park budget and backoff: its MaxAttempts counts the
	// retrier's rounds on a parked message (each round runs the wrapped
	// handler once, with whatever in-place retries it has inside), its
	// MaxElapsedTime counts from the message's first failure. Default
	// DefaultPolicy; a zero field of a set policy takes retry's default.
	// It must be bounded (MaxAttempts or MaxElapsedTime).
	Retry retry.Policy
	// Key returns a message's ordering key. Default DefaultKey. A message
	// with the key "" is parked under its own UUID: alone, ordered with
	// nothing.
	Key func(*message.Message) string
	// OnDeadLetter is what a dead letter does to its key's later messages.
	// Default Hold.
	OnDeadLetter OnDeadLetter
	// ConsumerGroup is recorded on dead letters. Default "".
	ConsumerGroup string
	// DeadLetterTopic names the dead_letter topic recorded on dead letters
	// (they are written to millwright_dead_letters directly, not
	// published). Default dlq.DefaultTopic.
	DeadLetterTopic func(topic string) string
	// PollInterval is how often Run looks for due keys when it has no
	// other reason to. Default 1s; at least 10ms.
	PollInterval time.Duration
	// Lease is how long a retrier owns a claimed key: a key whose retrier
	// died (or whose round runs longer) is due again after it, and may then
	// be claimed by another instance. Default 1m; at least 1s; keep it
	// above the handler's longest round (its in-place retries included).
	Lease time.Duration
	// Concurrency is how many keys Run retries at once. Default 4; 1..1024.
	Concurrency int
	// Publish publishes the messages a handler returns when the retrier
	// runs it (the router publishes them on first delivery). Default nil: a
	// retried handler that returns messages fails permanently, saying so.
	Publish func(handler string, msgs []*message.Message) error
	// Logger receives one line per parked key, dead letter and retrier
	// error. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Registerer registers MetricParked and MetricRetries. Default nil.
	Registerer prometheus.Registerer
}

func (c *Config) setDefaults() {
	if c.Retry == (retry.Policy{}) {
		c.Retry = DefaultPolicy
	}
	c.Retry = c.Retry.WithDefaults()
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.OnDeadLetter == "" {
		c.OnDeadLetter = Hold
	}
	if c.DeadLetterTopic == nil {
		c.DeadLetterTopic = dlq.DefaultTopic
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.Lease == 0 {
		c.Lease = time.Minute
	}
	if c.Concurrency == 0 {
		c.Concurrency = 4
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if _, nop := c.Logger.(watermill.NopLogger); !nop {
		c.Logger = redact.Logger(c.Logger)
	}
}

// Validate reports a configuration that cannot work, naming the field.
func (c Config) Validate() error {
	var errs []error
	if err := c.Retry.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("park: invalid Config.Retry: %w", err))
	}
	if c.Retry.MaxAttempts < 0 && c.Retry.MaxElapsedTime == 0 {
		errs = append(errs, errors.New("park: Config.Retry has no limit (MaxAttempts -1, MaxElapsedTime 0): a parked key would never reach the DLQ; set MaxAttempts or MaxElapsedTime"))
	}
	if c.OnDeadLetter != Hold && c.OnDeadLetter != Continue {
		errs = append(errs, fmt.Errorf("park: unknown Config.OnDeadLetter %q: want %q or %q", c.OnDeadLetter, Hold, Continue))
	}
	if c.PollInterval < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("park: Config.PollInterval %s: want >= 10ms", c.PollInterval))
	}
	if c.Lease < time.Second {
		errs = append(errs, fmt.Errorf("park: Config.Lease %s: want >= 1s", c.Lease))
	}
	if c.Concurrency < 1 || c.Concurrency > 1024 {
		errs = append(errs, fmt.Errorf("park: Config.Concurrency %d: want 1..1024", c.Concurrency))
	}
	return errors.Join(errs...)
}

// Parker parks the messages of failing keys in Postgres and retries them.
// Create it with New; its Middleware guards handlers, its Run retries
// their parked keys. Safe for concurrent use.
type Parker struct {
	pool storage.Pool
	cfg  Config

	mu        sync.Mutex
	handlers  map[string]message.HandlerFunc
	conflicts error // every refused second registration of a name

	wake chan struct{}
	// run is Run, Close and Running: the one lifecycle of the long-running
	// components, with no close timeout (Close cancels the rounds in
	// flight at once, then waits for them).
	run *runner.Runner

	parked    *prometheus.CounterVec
	retries   *prometheus.CounterVec
	setAsideC *prometheus.CounterVec
	stats     struct {
		failed, behind, replaced, ok, retryFailed, deadLetters, setAside atomic.Uint64
	}
}

// New returns a Parker on db, a *sql.DB or a *pgxpool.Pool whose
// search_path reaches the park and dlq tables (see Migrations).
func New(db postgres.DB, cfg Config) (*Parker, error) {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		return nil, fmt.Errorf("park: New: db is nil; pass postgres.From(pool) of an open *sql.DB or *pgxpool.Pool: %w", err)
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Parker{pool: pool, cfg: cfg, handlers: map[string]message.HandlerFunc{},
		wake: make(chan struct{}, 1), run: runner.New("park.Parker", 0)}
	if cfg.Registerer != nil {
		if p.parked, err = counter(cfg.Registerer, MetricParked, "Messages parked, by handler and cause (failed, behind).", "handler", "cause"); err != nil {
			return nil, err
		}
		if p.retries, err = counter(cfg.Registerer, MetricRetries, "Retrier rounds on parked messages, by handler and outcome (ok, failed, dead_letter).", "handler", "outcome"); err != nil {
			return nil, err
		}
		if p.setAsideC, err = counter(cfg.Registerer, MetricSetAside, "Parked records the retrier could not handle (handler_panic, panic, bad_row), held for an operator, by handler and cause.", "handler", "cause"); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func counter(reg prometheus.Registerer, name, help string, labels ...string) (*prometheus.CounterVec, error) {
	cv, err := promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels))
	if err != nil {
		return nil, fmt.Errorf("park: registering metric %s: %w", name, err)
	}
	return cv, nil
}

// Stats is a snapshot of a Parker's counts since New.
type Stats struct {
	// ParkedFailed counts messages parked because their handler failed;
	// ParkedBehind those parked behind their parked key without running.
	ParkedFailed, ParkedBehind uint64
	// Replaced counts replayed dead letters that took their parked
	// message's place.
	Replaced uint64
	// Retried counts retrier rounds that succeeded, RetryFailed those that
	// failed and were rescheduled, DeadLetters the messages dead-lettered
	// (by the middleware on a permanent error, or by the retrier).
	Retried, RetryFailed, DeadLetters uint64
	// SetAside counts records the retrier could not handle (MetricSetAside).
	SetAside uint64
}

// Stats returns the Parker's counts.
func (p *Parker) Stats() Stats {
	return Stats{ParkedFailed: p.stats.failed.Load(), ParkedBehind: p.stats.behind.Load(), Replaced: p.stats.replaced.Load(), Retried: p.stats.ok.Load(),
		RetryFailed: p.stats.retryFailed.Load(), DeadLetters: p.stats.deadLetters.Load(), SetAside: p.stats.setAside.Load()}
}

func (p *Parker) countParked(handler, cause string) {
	switch cause {
	case "behind":
		p.stats.behind.Add(1)
	case "replaced":
		p.stats.replaced.Add(1)
	default:
		p.stats.failed.Add(1)
	}
	if p.parked != nil {
		p.parked.WithLabelValues(handler, cause).Inc()
	}
}

func (p *Parker) countRetry(handler, outcome string) {
	switch outcome {
	case "ok":
		p.stats.ok.Add(1)
	case "failed":
		p.stats.retryFailed.Add(1)
	default:
		p.stats.deadLetters.Add(1)
	}
	if p.retries != nil {
		p.retries.WithLabelValues(handler, outcome).Inc()
	}
}

// ErrDuplicateHandler is returned (wrapped, naming the handler) for every
// message of a handler whose name another handler of the same Parker
// already has, and by Run when such a handler was wrapped before it
// started.
var ErrDuplicateHandler = errors.New("park: handler name already taken")

// register records h as the handler named name, for the retrier. A name
// is taken once: a second handler under it would share the first's
// parked keys in the database, and the retrier would run every parked
// message of both with whichever handler was registered last.
func (p *Parker) register(name string, h message.HandlerFunc) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, taken := p.handlers[name]; taken {
		err := fmt.Errorf("%w: two handlers of one Parker are named %q (Middleware(%q) wrapped a second handler, or park's middleware was added to the router instead of to one handler): give each handler its own name with h.AddMiddleware(parker.Middleware(NAME)), the same in every instance; the first handler keeps the name, the second's messages are nacked",
			ErrDuplicateHandler, name, name)
		p.conflicts = errors.Join(p.conflicts, err)
		return err
	}
	p.handlers[name] = h
	return nil
}

// conflict returns the refused registrations so far, or nil.
func (p *Parker) conflict() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conflicts
}

func (p *Parker) handler(name string) message.HandlerFunc {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.handlers[name]
}

func (p *Parker) handlerNames() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.handlers))
	for n := range p.handlers {
		out = append(out, n)
	}
	return out
}

// poke wakes Run: a key's next message is due now.
func (p *Parker) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}
