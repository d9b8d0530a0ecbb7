// Package relayenv is the environment configuration of `millwright relay`:
// one table of the variables it reads (Vars), their defaults and their
// parsing. The command and the test of deploy/kubernetes's manifest both
// read this table, so that a name or port cannot drift between them.
package relayenv

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/retention"
	"github.com/millwright/millwright/transport"
)

// The variables `millwright relay` reads itself. The transport's own
// (MILLWRIGHT_TRANSPORT and the per-kind ones, TransportVars) are read by
// transport.FromEnv.
const (
	DatabaseURL          = transport.EnvDatabaseURL
	Addr                 = transport.EnvPrefix + "RELAY_ADDR"
	Relays               = transport.EnvPrefix + "RELAY_COUNT"
	BatchSize            = transport.EnvPrefix + "RELAY_BATCH_SIZE"
	Workers              = transport.EnvPrefix + "RELAY_WORKERS"
	PollInterval         = transport.EnvPrefix + "RELAY_POLL_INTERVAL"
	Listen               = transport.EnvPrefix + "RELAY_LISTEN"
	DeadLetterTopic      = transport.EnvPrefix + "RELAY_DEAD_LETTER_TOPIC"
	DrainTimeout         = transport.EnvPrefix + "RELAY_DRAIN_TIMEOUT"
	Lease                = transport.EnvPrefix + "RELAY_LEASE"
	ReadyMaxAge          = transport.EnvPrefix + "RELAY_READY_MAX_AGE"
	MaxConns             = transport.EnvPrefix + "RELAY_DB_MAX_CONNS"
	Driver               = transport.EnvPrefix + "DATABASE_DRIVER"
	OutboxRetention      = transport.EnvPrefix + "OUTBOX_RETENTION"
	IdempotencyRetention = transport.EnvPrefix + "IDEMPOTENCY_RETENTION"
	DLQRetention         = transport.EnvPrefix + "DLQ_RETENTION"
	SagaRetention        = transport.EnvPrefix + "SAGA_RETENTION"
	AuditRetention       = transport.EnvPrefix + "AUDIT_RETENTION"
	CleanInterval        = transport.EnvPrefix + "CLEAN_INTERVAL"
)

// DefaultPort is the port of DefaultAddr: /metrics, /healthz and /readyz.
const DefaultPort = 9090

// PathMetrics is where the relay serves Prometheus metrics (health.PathLive
// and health.PathReady are the probes').
const PathMetrics = "/metrics"

// DefaultAddr is Addr's default: every interface, because the
// orchestrator's probes and Prometheus reach a pod at its own IP, not at
// its loopback (deploy/kubernetes). Outside a container, set Addr (or
// --addr) to 127.0.0.1:9090 to keep /metrics off the network.
var DefaultAddr = ":" + strconv.Itoa(DefaultPort)

// The relay's HTTP server bounds each phase of a connection, so that idle
// keep-alive connections and slow clients cannot pile up.
const (
	// HTTPReadHeaderTimeout bounds reading a request's headers.
	HTTPReadHeaderTimeout = 5 * time.Second
	// HTTPReadTimeout bounds reading a whole request, body included.
	HTTPReadTimeout = 10 * time.Second
	// HTTPWriteTimeout bounds a request from the end of its headers to the
	// end of the response: above a readiness evaluation (health's
	// CheckTimeout, 2 s) and a /metrics scrape.
	HTTPWriteTimeout = 30 * time.Second
	// HTTPIdleTimeout closes a keep-alive connection that waits this long
	// for its next request.
	HTTPIdleTimeout = 60 * time.Second
)

// ReadyAppName is the application_name of the readiness checks'
// connection (one, outside the relays' pool), unless DatabaseURL sets an
// application_name (the connection then has that + "/readyz"):
// pg_stat_activity shows it.
const ReadyAppName = "millwright-relay-readyz"

// ReadyCacheFor is how long a readiness evaluation answers later /readyz
// requests (health.Config.CacheFor): a flood of probes pings the database
// at most once per this.
const ReadyCacheFor = time.Second

// CheckAddr reports whether addr is a listen address of the form Addr
// takes: host:port or :port.
func CheckAddr(addr string) error {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return fmt.Errorf("want host:port or :port, e.g. %s (every interface) or 127.0.0.1:%d (this host only)", DefaultAddr, DefaultPort)
	}
	return nil
}

// Var documents one variable.
type Var struct {
	Name string
	// Default is the value used when the variable is unset, as the help
	// prints it after "default ", or Required.
	Default string
	Doc     string
}

// Required is the Default of a variable that has none: Help prints
// "(required)". (It once was "(required)", which Help wrapped in
// parentheses again: "((required))".)
const Required = "required"

// Vars is every variable the relay reads itself, in the order of its help.
var Vars = []Var{
	{DatabaseURL, Required, "Postgres URL of the service's database; its search_path selects the schema holding millwright_outbox. Also the LISTEN connection's URL, so it must reach Postgres directly or through a session-pooling proxy."},
	{transport.EnvTransport, Required, "transport kind or URL (kafka, amqp, googlecloud, sql, gochannel); the per-kind MILLWRIGHT_* variables of package transport apply"},
	{Addr, DefaultAddr, "HTTP address of /metrics, /healthz and /readyz (--addr takes its place): every interface by default, as the orchestrator's probes and Prometheus reach the pod at its IP; 127.0.0.1:9090 keeps them on this host"},
	{Relays, "1", "relays run in this process (1..64); more than one helps only when one relay's round trip to the broker is the limit"},
	{BatchSize, "500", "rows claimed and published at a time per relay (1..10000)"},
	{Workers, "4", "batches the running relays of the outbox keep in flight together while they have a backlog (1..64; relay.Config.Workers): each relay publishes ceil(this / live relays) groups of its lanes at once"},
	{PollInterval, "1s", "how often an idle relay looks for rows when no notification wakes it"},
	{Listen, "true", "LISTEN for the outbox trigger's notifications on " + DatabaseURL + " (two extra connections per relay); false polls only"},
	{DeadLetterTopic, "", "topic receiving a copy of each event that exhausts its attempts (empty: rows are only marked failed)"},
	{DrainTimeout, "20s", "on SIGTERM, how long the batches in flight may take to finish before they are abandoned (their rows are republished after the lease); keep it below the pod's terminationGracePeriodSeconds"},
	{Lease, "30s", "how long a relay's hold on its lanes lasts without renewal (relay.Config.Lease, at least 1s): a batch's publish is cut a tenth of it before the lanes' lease ends, so keep the slowest batch under about 0.4 x this; a relay that dies is replaced after it"},
	{ReadyMaxAge, "30s", "/readyz fails when a relay's last successful round is older than this"},
	{Driver, "pgx", "Postgres driver the relays and cleaners run on: pgx (a pgxpool.Pool) or pq (database/sql on lib/pq); --driver takes its place. The sql transport and /readyz use database/sql either way"},
	{MaxConns, "4 per relay + 4", "size of the relays' and cleaners' database pool; /readyz pings through one connection of its own, and LISTEN adds two per relay"},
	{OutboxRetention, "168h", "age at which published outbox rows are deleted by the outbox cleaner; 0 disables it"},
	{IdempotencyRetention, retention.DefaultIdempotencyRetention.String(), "age at which processed-event rows are deleted by the idempotency cleaner (only when millwright_processed_events exists); 0 disables it"},
	{DLQRetention, retention.DefaultDeadLetterRetention.String(), "age at which dead letters (replayed or not) are deleted by the dead-letter cleaner (only when millwright_dead_letters exists); 0 disables it"},
	{SagaRetention, retention.DefaultSagaRetention.String(), "age at which completed and compensated sagas, with their steps, are deleted by the saga cleaner (only when millwright_saga_instances exists; running, compensating and stuck sagas are never deleted); 0 disables it"},
	{AuditRetention, retention.DefaultAuditRetention.String(), "age at which audit rows are deleted by the audit cleaner (only when millwright_audit exists); 0 disables it"},
	{CleanInterval, "1m", "interval between cleaning rounds"},
}

// TransportVars are the transport's variables (transport.FromEnv), which a
// deployment of the relay may set too.
var TransportVars = []string{
	transport.EnvTransport,
	transport.EnvKafkaBrokers, transport.EnvKafkaTLS, transport.EnvKafkaTLSCAFile,
	transport.EnvKafkaSASLMechanism, transport.EnvKafkaSASLUser, transport.EnvKafkaSASLPassword,
	transport.EnvKafkaPartitions, transport.EnvKafkaPartitioner, transport.EnvKafkaKeyParallelism, transport.EnvKafkaKeyMaxInFlight,
	transport.EnvAMQPURL, transport.EnvAMQPPrefetch, transport.EnvAMQPKeyParallelism, transport.EnvAMQPAllowUnroutable,
	transport.EnvPubSubProject, transport.EnvPubSubEmulatorHost, transport.EnvPubSubCredentialsFile, transport.EnvPubSubAllowUnreceived,
	transport.EnvNATSURL, transport.EnvNATSKeyParallelism, transport.EnvNATSAckWait,
	transport.EnvSQLURL, transport.EnvDeclareGroups,
}

// Known reports whether name is a variable the relay or its transport reads.
func Known(name string) bool {
	for _, v := range Vars {
		if v.Name == name {
			return true
		}
	}
	for _, v := range TransportVars {
		if v == name {
			return true
		}
	}
	return false
}

// Config is the parsed configuration (the transport's excepted).
type Config struct {
	DatabaseURL     string
	Addr            string
	Relays          int
	BatchSize       int
	Workers         int
	PollInterval    time.Duration
	Listen          bool
	DeadLetterTopic string
	DrainTimeout    time.Duration
	Lease           time.Duration
	ReadyMaxAge     time.Duration
	MaxConns        int
	// Driver is "pgx" or "pq".
	Driver               string
	OutboxRetention      time.Duration
	IdempotencyRetention time.Duration
	DLQRetention         time.Duration
	SagaRetention        time.Duration
	AuditRetention       time.Duration
	CleanInterval        time.Duration
}

// FromEnv parses the variables from the process environment.
func FromEnv() (Config, error) { return Load(os.LookupEnv) }

// Load parses the variables through lookup, reporting every invalid one,
// each by name with the value wanted.
func Load(lookup func(string) (string, bool)) (Config, error) {
	get := func(k string) string { v, _ := lookup(k); return strings.TrimSpace(v) }
	c := Config{
		Addr: DefaultAddr, Relays: 1, BatchSize: 500, Workers: 4, PollInterval: time.Second, Listen: true,
		DrainTimeout: 20 * time.Second, Lease: 30 * time.Second, ReadyMaxAge: 30 * time.Second,
		OutboxRetention: retention.DefaultOutboxRetention, IdempotencyRetention: retention.DefaultIdempotencyRetention,
		DLQRetention: retention.DefaultDeadLetterRetention, SagaRetention: retention.DefaultSagaRetention, AuditRetention: retention.DefaultAuditRetention,
		CleanInterval: time.Minute,
	}
	var errs []error
	c.DatabaseURL = get(DatabaseURL)
	if c.DatabaseURL == "" {
		errs = append(errs, fmt.Errorf("%s is not set: set it to the postgres:// URL of the service's database, with search_path selecting the outbox's schema if it is not the default", DatabaseURL))
	}
	if v := get(Addr); v != "" {
		if err := CheckAddr(v); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", Addr, v, err))
		}
		c.Addr = v
	}
	intVar := func(name string, dst *int, lo, hi int) {
		v := get(name)
		if v == "" {
			return
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < lo || n > hi {
			errs = append(errs, fmt.Errorf("%s=%q: want an integer in %d..%d", name, v, lo, hi))
			return
		}
		*dst = n
	}
	durVar := func(name string, dst *time.Duration, lo time.Duration) {
		v := get(name)
		if v == "" {
			return
		}
		d, err := time.ParseDuration(v)
		if err != nil || d < lo {
			errs = append(errs, fmt.Errorf("%s=%q: want a duration of at least %s, e.g. 30s or 168h", name, v, lo))
			return
		}
		*dst = d
	}
	intVar(Relays, &c.Relays, 1, 64)
	intVar(BatchSize, &c.BatchSize, 1, 10000)
	intVar(Workers, &c.Workers, 1, 64)
	c.MaxConns = 4*c.Relays + 4
	intVar(MaxConns, &c.MaxConns, 2, 10000)
	durVar(PollInterval, &c.PollInterval, time.Millisecond)
	durVar(DrainTimeout, &c.DrainTimeout, 0)
	durVar(Lease, &c.Lease, time.Second)
	durVar(ReadyMaxAge, &c.ReadyMaxAge, time.Second)
	durVar(OutboxRetention, &c.OutboxRetention, 0)
	durVar(IdempotencyRetention, &c.IdempotencyRetention, 0)
	durVar(DLQRetention, &c.DLQRetention, 0)
	durVar(SagaRetention, &c.SagaRetention, 0)
	durVar(AuditRetention, &c.AuditRetention, 0)
	durVar(CleanInterval, &c.CleanInterval, time.Millisecond)
	if v := get(Listen); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: want true or false", Listen, v))
		}
		c.Listen = b
	}
	c.DeadLetterTopic = get(DeadLetterTopic)
	switch c.Driver = strings.ToLower(get(Driver)); c.Driver {
	case "":
		c.Driver = "pgx"
	case "pgx", "pq":
	default:
		errs = append(errs, fmt.Errorf("%s=%q: want pgx or pq", Driver, get(Driver)))
	}
	if c.ReadyMaxAge <= c.PollInterval {
		errs = append(errs, fmt.Errorf("%s %s must exceed %s %s: an idle relay succeeds once per poll interval", ReadyMaxAge, c.ReadyMaxAge, PollInterval, c.PollInterval))
	}
	return c, errors.Join(errs...)
}

// Help lists the variables for `millwright relay --help`.
func Help() string {
	var b strings.Builder
	for _, v := range Vars {
		def := v.Default
		if def == "" {
			def = `""`
		}
		if def != Required {
			def = "default " + def
		}
		fmt.Fprintf(&b, "  %s (%s)\n      %s\n", v.Name, def, v.Doc)
	}
	return b.String()
}
