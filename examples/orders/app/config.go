package app

import (
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
)

// Service names one deployable part of the example. Each runs as its own
// process with `go run ./examples/orders serve <service>`, or all of them
// together in one process.
type Service string

// The services.
const (
	// Orders is the order service's HTTP API (POST /orders, GET
	// /orders/{id}); it writes the order and order.created.v1 in one
	// transaction through the outbox.
	Orders Service = "orders"
	// Orchestrator runs the order_fulfilment saga: it starts a saga for
	// every order.created.v1, consumes the participants' replies, fires step
	// timeouts, and settles the order (completed or cancelled).
	Orchestrator Service = "orchestrator"
	// Inventory reserves and releases stock.
	Inventory Service = "inventory"
	// Billing charges and refunds payments.
	Billing Service = "billing"
	// Shipping schedules and cancels shipments.
	Shipping Service = "shipping"
	// Notify is a second reader of the order events (fan-out): it records
	// one notification per order event.
	Notify Service = "notify"
	// Relay publishes the outbox through the transport, and runs the
	// outbox and idempotency cleaners (7-day retention).
	Relay Service = "relay"
	// DeadLetters records every dead-letter topic in millwright_dead_letters.
	DeadLetters Service = "dlq"
)

// AllServices lists every service, in the order they start.
var AllServices = []Service{DeadLetters, Inventory, Billing, Shipping, Notify, Orchestrator, Relay, Orders}

// ParseService returns the service named s.
func ParseService(s string) (Service, error) {
	for _, x := range AllServices {
		if string(x) == s {
			return x, nil
		}
	}
	return "", fmt.Errorf("unknown service %q: want one of orders, orchestrator, inventory, billing, shipping, notify, relay, dlq", s)
}

// Config wires the example to its database and transport.
type Config struct {
	// Pgx holds every table of the example (AllMigrations applied): the
	// services run on pgx v5, handlers on a pgx.Tx. Set Pgx or DB.
	Pgx *pgxpool.Pool
	// DB is Pgx on database/sql (lib/pq): handlers run on a *sql.Tx. Set
	// Pgx or DB.
	DB *sql.DB
	// DatabaseURL reaches DB's database and schema; the relay LISTENs on
	// it to wake up at commit. Default "": the relay polls.
	DatabaseURL string
	// Transport carries the events and commands. Required.
	Transport *transport.Transport
	// TopicPrefix is prepended to every topic, so that several runs can
	// share a broker (tests). Default "".
	TopicPrefix string
	// Registerer receives every millwright metric. Default: a new
	// registry, see App.Gatherer.
	Registerer prometheus.Registerer
	// Logger. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// ConsumerRetry is the retry policy of every consumer before a message
	// is dead-lettered. Default InitialInterval 50ms, MaxInterval 1s,
	// MaxAttempts 8.
	ConsumerRetry retry.Policy
	// Park guards every consumer (but the dead-letter recorders) with
	// package park instead of dlq's middleware: a message that still fails
	// after a few in-place retries is parked in Postgres, its key's later
	// messages park behind it in order, and the consumer goes on with the
	// other keys; a retrier (one per consumer group, started with the
	// consumers) retries parked keys with ParkRetry and then writes the
	// dead letter itself. Default false: dlq's middleware, which retries
	// in place with ConsumerRetry and then publishes the dead letter.
	Park bool
	// ParkRetry is the parked messages' retry budget and backoff. Default:
	// park.DefaultPolicy.
	ParkRetry retry.Policy
	// Duplicate delivers every message to every consumer twice (Watermill's
	// middleware.Duplicator), to show that effects still happen once.
	// Default false.
	Duplicate bool
	// StepTimeout is how long the saga waits for a participant's reply
	// before it compensates. Default 1 minute.
	StepTimeout time.Duration
	// SagaVersion is the version of the order saga new orders start on:
	// 1, reserve, then charge, then ship; 2 (the default), reserve and
	// charge at once (a parallel group), then ship. Both versions are
	// always registered, so that an order started on one finishes by its
	// steps whichever version the process starts new orders on: a deploy
	// from 1 to 2 (or back) leaves no order behind.
	SagaVersion int
	// SagaPollInterval is how often the orchestrator looks for due
	// timeouts. Default 1s.
	SagaPollInterval time.Duration
	// RelayLease is the outbox relay's lease (how long rows of a relay that
	// died wait before another relay takes them). Default 30s.
	RelayLease time.Duration
	// RelayRetry is the relay's backoff for rows whose publish fails.
	// Default: the outbox's (500ms .. 1m, 20 attempts).
	RelayRetry retry.Policy
	// RelayPublisher, when set, wraps the publisher the relay uses (fault
	// injection in tests). Default nil.
	RelayPublisher func(message.Publisher) message.Publisher
	// PaymentLimitCents is the largest amount billing accepts; larger
	// orders fail payment. Default 100000 (1,000.00).
	PaymentLimitCents int64
}

func (c *Config) setDefaults() {
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.ConsumerRetry.InitialInterval == 0 {
		c.ConsumerRetry.InitialInterval = 50 * time.Millisecond
	}
	if c.ConsumerRetry.MaxInterval == 0 {
		c.ConsumerRetry.MaxInterval = time.Second
	}
	if c.ConsumerRetry.MaxAttempts == 0 {
		c.ConsumerRetry.MaxAttempts = 8
	}
	if c.StepTimeout == 0 {
		c.StepTimeout = time.Minute
	}
	if c.SagaPollInterval == 0 {
		c.SagaPollInterval = time.Second
	}
	if c.SagaVersion == 0 {
		c.SagaVersion = 2
	}
	if c.PaymentLimitCents == 0 {
		c.PaymentLimitCents = 100000
	}
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	var errs []error
	switch {
	case c.DB == nil && c.Pgx == nil:
		errs = append(errs, errors.New("orders: Config.Pgx and Config.DB are nil: pass the *pgxpool.Pool (or the *sql.DB) holding the example's tables"))
	case c.DB != nil && c.Pgx != nil:
		errs = append(errs, errors.New("orders: both Config.Pgx and Config.DB are set: pass one pool, on the driver the services should use"))
	}
	if c.Transport == nil {
		errs = append(errs, errors.New("orders: Config.Transport is nil: open one with transport.Open"))
	}
	if c.PaymentLimitCents < 0 {
		errs = append(errs, fmt.Errorf("orders: Config.PaymentLimitCents %d is negative", c.PaymentLimitCents))
	}
	if c.SagaVersion != 1 && c.SagaVersion != 2 {
		errs = append(errs, fmt.Errorf("orders: Config.SagaVersion %d: want 1 (reserve, charge, ship) or 2 (reserve and charge at once, then ship)", c.SagaVersion))
	}
	return errors.Join(errs...)
}

// Topics are the example's topics, after Config.TopicPrefix.
type Topics struct {
	// OrderEvents carries order.created.v1, order.completed.v1 and
	// order.cancelled.v1.
	OrderEvents string
	// InventoryCommands, BillingCommands and ShippingCommands carry the
	// saga's commands to each participant.
	InventoryCommands string
	BillingCommands   string
	ShippingCommands  string
	// Replies carries the participants' replies to the orchestrator.
	Replies string
}

// NewTopics returns the topic names with prefix.
func NewTopics(prefix string) Topics {
	return Topics{
		OrderEvents:       prefix + "orders.events",
		InventoryCommands: prefix + "inventory.commands",
		BillingCommands:   prefix + "billing.commands",
		ShippingCommands:  prefix + "shipping.commands",
		Replies:           prefix + "order_fulfilment.replies",
	}
}

// All lists every topic.
func (t Topics) All() []string {
	return []string{t.OrderEvents, t.InventoryCommands, t.BillingCommands, t.ShippingCommands, t.Replies}
}

// Consumer groups. With AMQP and Pub/Sub they name queues and
// subscriptions; declare them up front (transport DeclareGroups, env
// MILLWRIGHT_DECLARE_GROUPS) when services start after the first publish.
const (
	GroupOrchestrator = "orchestrator"
	GroupInventory    = "inventory"
	GroupBilling      = "billing"
	GroupShipping     = "shipping"
	GroupNotify       = "notify"
	GroupDeadLetters  = "dlq-recorder"
)

// Groups lists every consumer group.
var Groups = []string{GroupOrchestrator, GroupInventory, GroupBilling, GroupShipping, GroupNotify, GroupDeadLetters}
