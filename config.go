package millwright

import (
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/transport"
)

// Config configures a Client. Only Name is required; every other field
// has a default, which its comment gives with its valid range.
type Config struct {
	// Name names the service. It prefixes every consumer group
	// (Name + "." + handler name), which is also the handler's
	// idempotency consumer and park's consumer group, and is the
	// CloudEvents source of the events Add writes ("/" + Name). Required:
	// letters, digits, '.', '_' and '-', starting with a letter; at most
	// 30 bytes, so that its groups fit every transport's name limit.
	// Keep it stable across deploys: a renamed service is a new consumer.
	Name string

	// Transport selects the broker. Default (Kind empty): the
	// MILLWRIGHT_ environment (transport.FromEnv, MILLWRIGHT_TRANSPORT
	// and the kind's variables), and when MILLWRIGHT_TRANSPORT is unset,
	// the sql transport on DatabaseURL. Its WaitForBroker, when 0, is
	// StartTimeout.
	Transport transport.Config
	// DatabaseURL is the service database's URL: the relay LISTENs on it
	// (relay.Config.ListenURL) and, with no transport configured,
	// the sql transport uses it. Default: the pgx pool's connection
	// string; on database/sql, "" (the relay polls, and a transport must
	// be configured).
	DatabaseURL string

	// Migrate applies millwright's migrations (migrations.All: outbox,
	// idempotency, dlq, park, saga, audit), then Migrations, when Run
	// starts. Default false: the tables must exist (`millwright migrate`).
	Migrate bool
	// Migrations are the service's own, applied after millwright's when
	// Migrate is set. Default none.
	Migrations []migrate.Source

	// StartTimeout bounds how long Run waits for the database and the
	// broker at start (each attempt logged; a service started before its
	// broker waits for it). A migration in progress is not cut by it. Default 2 minutes; -1 waits until Run's ctx
	// ends; otherwise at least 1s.
	StartTimeout time.Duration
	// Grace is how long Run takes, at most, to return after its ctx ends:
	// handlers in flight finish meanwhile (their contexts stay live until
	// Grace minus 2 s), then the relay, orchestrators, park's retriers and
	// cleaners drain, and the transport closes. Run returns nil when every
	// handler finished in time. Default shutdown.DefaultServiceGrace
	// (25 s, inside Kubernetes' 30 s); valid 3s..1h.
	Grace time.Duration

	// Retry is the in-place retry of a failing message, inside park: it
	// absorbs blips (a deadlock, a dropped connection) while holding the
	// partition, so keep it short. Default 3 attempts, 20 ms doubling to
	// 200 ms, full jitter. It must be bounded.
	Retry retry.Policy
	// Park is the budget of a message still failing after Retry: its key
	// is parked (its later messages wait behind it, other keys go on) and
	// retried with this backoff, then dead-lettered. Default
	// park.DefaultPolicy (10 rounds, 1 s doubling to 5 min). It must be
	// bounded.
	Park retry.Policy
	// OnDeadLetter is what a dead letter does to its key's later
	// messages: park.Hold (they wait for an operator) or park.Continue.
	// Default park.Hold.
	OnDeadLetter park.OnDeadLetter
	// KeyParallelism makes the Kafka, RabbitMQ and NATS consumers
	// key-parallel (transport.KafkaConfig.KeyParallelism,
	// AMQPConfig.KeyParallelism, NATSConfig.KeyParallelism)
	// when the transport's own setting is 0: that many keys of one
	// partition or queue in flight at once, each key in order (park
	// keeps a failing key's later messages behind it only if they arrive
	// in order). On RabbitMQ the key-parallel consumer holds its queue
	// exclusively: a second process of the group is a standby. Other
	// kinds deliver by ordering key already. Default 16; -1 leaves the
	// transport's setting (one message at a time, or its environment's
	// MILLWRIGHT_KAFKA_KEY_PARALLELISM / MILLWRIGHT_AMQP_KEY_PARALLELISM /
	// MILLWRIGHT_NATS_KEY_PARALLELISM);
	// valid -1..1024.
	KeyParallelism int

	// MaxHandlers bounds the messages whose handlers run at once, over
	// every handler of the client: an idempotent handler holds a database
	// connection for as long as it runs, so more would only queue for the
	// pool (and at shutdown be found in flight). A message beyond waits
	// for a slot; when shutdown begins, the messages still waiting are
	// nacked, never started (the broker redelivers them). Default the
	// pool's maximum connections minus 2 (kept for the relay, the
	// orchestrators and park's retriers), at least 1; on a *sql.DB
	// without SetMaxOpenConns, 16. Valid 1..4096.
	MaxHandlers int

	// Relay configures the outbox relay Run starts. Its Logger,
	// Registerer and ListenURL default to the client's, its CloseTimeout
	// to 2 s. With DeadLetterTopic set, the client also records that
	// topic's dead letters in millwright_dead_letters (handler
	// "relay-dead-letters"). Default: the relay's defaults.
	Relay relay.Config
	// NoRelay leaves the relay out of Run: another process relays this
	// database's outbox (`millwright relay`). Default false.
	NoRelay bool
	// Retention is how long each table's finished rows are kept; Run
	// cleans them. Default: each component's DefaultRetention.
	Retention Retention

	// Registry receives every component's metrics; MetricsHandler serves
	// it. Default: a new prometheus.Registry with the Go and process
	// collectors.
	Registry *prometheus.Registry
	// Logger receives the components' logs. Default slog.Default().
	Logger *slog.Logger
}

// Retention configures the cleaners Run starts, one per table. A zero
// field takes the component's DefaultRetention; -1 turns that table's
// cleaner off. Valid: -1, 0, or at least an hour.
type Retention struct {
	// Outbox: published events. Default outbox.DefaultRetention (7 days).
	Outbox time.Duration
	// Idempotency: processed marks. Default idempotency.DefaultRetention
	// (7 days); keep it above the longest redelivery delay.
	Idempotency time.Duration
	// DeadLetters: dead letters, replayed or not. Default
	// dlq.DefaultRetention (90 days).
	DeadLetters time.Duration
	// Sagas: completed and compensated sagas. Default
	// saga.DefaultRetention (30 days).
	Sagas time.Duration
}

// The defaults of Config.
const (
	DefaultStartTimeout   = 2 * time.Minute
	DefaultKeyParallelism = 16
	// graceMargin is what Grace keeps, after the handlers' drain, for the
	// other components and the transport to close.
	graceMargin = 2 * time.Second
)

// DefaultRetry is Config.Retry's default.
var DefaultRetry = retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxAttempts: 3, Jitter: retry.JitterFull}

var serviceName = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]*$`)

func (c *Config) setDefaults(db postgres.DB) {
	if c.StartTimeout == 0 {
		c.StartTimeout = DefaultStartTimeout
	}
	if c.Grace == 0 {
		c.Grace = shutdown.DefaultServiceGrace
	}
	if c.Retry == (retry.Policy{}) {
		c.Retry = DefaultRetry
	}
	c.Retry = c.Retry.WithDefaults()
	if c.Park == (retry.Policy{}) {
		c.Park = park.DefaultPolicy
	}
	c.Park = c.Park.WithDefaults()
	if c.OnDeadLetter == "" {
		c.OnDeadLetter = park.Hold
	}
	if c.KeyParallelism == 0 {
		c.KeyParallelism = DefaultKeyParallelism
	}
	if c.MaxHandlers == 0 {
		c.MaxHandlers = defaultMaxHandlers(db)
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
		c.Registry.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every setting that cannot work, naming it and the fix.
func (c Config) Validate() error {
	var errs []error
	switch {
	case c.Name == "":
		errs = append(errs, errors.New(`millwright: Config.Name is empty: set it to the service's stable name, e.g. "payments"`))
	case len(c.Name) > 30 || !serviceName.MatchString(c.Name):
		errs = append(errs, fmt.Errorf("millwright: Config.Name %q: want 1 to 30 letters, digits, '.', '_' or '-', starting with a letter (it prefixes consumer groups)", c.Name))
	}
	if c.StartTimeout != -1 && c.StartTimeout < time.Second {
		errs = append(errs, fmt.Errorf("millwright: Config.StartTimeout %s: want at least 1s, or -1 to wait until Run's context ends (default %s)", c.StartTimeout, DefaultStartTimeout))
	}
	if c.Grace < 3*time.Second || c.Grace > time.Hour {
		errs = append(errs, fmt.Errorf("millwright: Config.Grace %s: want 3s..1h (default %s, inside Kubernetes' 30 s terminationGracePeriodSeconds)", c.Grace, shutdown.DefaultServiceGrace))
	}
	if err := bounded("Retry", c.Retry); err != nil {
		errs = append(errs, err)
	}
	if err := bounded("Park", c.Park); err != nil {
		errs = append(errs, err)
	}
	if c.OnDeadLetter != park.Hold && c.OnDeadLetter != park.Continue {
		errs = append(errs, fmt.Errorf("millwright: Config.OnDeadLetter %q: want park.Hold or park.Continue", c.OnDeadLetter))
	}
	if c.KeyParallelism < -1 || c.KeyParallelism > 1024 {
		errs = append(errs, fmt.Errorf("millwright: Config.KeyParallelism %d: want 1..1024, or -1 for the transport's own setting (default %d)", c.KeyParallelism, DefaultKeyParallelism))
	}
	if c.MaxHandlers < 1 || c.MaxHandlers > 4096 {
		errs = append(errs, fmt.Errorf("millwright: Config.MaxHandlers %d: want 1..4096 (default the pool's size minus 2), and a pool that large", c.MaxHandlers))
	}
	for name, d := range map[string]time.Duration{"Outbox": c.Retention.Outbox, "Idempotency": c.Retention.Idempotency,
		"DeadLetters": c.Retention.DeadLetters, "Sagas": c.Retention.Sagas} {
		if d != -1 && d != 0 && d < time.Hour {
			errs = append(errs, fmt.Errorf("millwright: Config.Retention.%s %s: want at least 1h, 0 for the default, or -1 for no cleaner", name, d))
		}
	}
	return errors.Join(errs...)
}

// defaultMaxHandlers is MaxHandlers' default for db.
func defaultMaxHandlers(db postgres.DB) int {
	n := 16 + 2
	if p := db.Pgx(); p != nil {
		n = int(p.Config().MaxConns)
	} else if d := db.SQL(); d != nil && d.Stats().MaxOpenConnections > 0 {
		n = d.Stats().MaxOpenConnections
	}
	return max(1, n-2)
}

func bounded(field string, p retry.Policy) error {
	if err := p.Validate(); err != nil {
		return fmt.Errorf("millwright: Config.%s: %w", field, err)
	}
	if p.MaxAttempts < 0 && p.MaxElapsedTime == 0 {
		return fmt.Errorf("millwright: Config.%s has no limit (MaxAttempts -1, MaxElapsedTime 0): set MaxAttempts or MaxElapsedTime", field)
	}
	return nil
}
