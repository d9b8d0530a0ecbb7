package outbox

import (
	"context"
	"fmt"
	"os"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/tracing"
	"github.com/millwright/millwright/transport"
)

// WriterConfig configures a Writer. The zero value is valid: it gives the
// Writer of the package-level Add.
type WriterConfig struct {
	// Limits are the rules of the transport the relay publishes the events
	// to: the topic must be a name that kind takes
	// (transport.ValidateName), and the event, counted as that kind counts
	// a message on the wire (payload, key, headers and the CloudEvents
	// attributes the relay adds), must fit Limits.MaxBytes; for Pub/Sub
	// each metadata value must fit an attribute (1,024 bytes), for the sql
	// transport the id its 36-character column. Take them from the relay's
	// transport, whether or not this process opens it:
	//
	//	cfg, err := transport.FromEnv() // the relay's MILLWRIGHT_TRANSPORT settings
	//	w, err := outbox.NewWriter(outbox.WriterConfig{Limits: transport.LimitsFor(cfg)})
	//	// or, with an open transport: outbox.WriterConfig{Limits: t.Limits()}
	//
	// Default (the zero Limits): transport.DefaultLimits(""), the rules
	// every kind shares with Kafka's size limit, DefaultMaxEventBytes.
	Limits transport.Limits
	// MaxEventBytes, above 0, replaces Limits.MaxBytes: for a broker whose
	// limit is lower than its kind's default (a Kafka topic's
	// max.message.bytes), which Limits cannot know. -1: no size limit.
	// Default 0: Limits.MaxBytes. The publisher still reports an event the
	// broker refuses for its size as a permanent error
	// (transport.ErrMessageTooLarge, failure.Permanent).
	MaxEventBytes int
	// Source is the CloudEvents source (metadata.EventSource) of events
	// written without Event.Source: a URI-reference such as
	// "/orders-service" or "https://example.com/orders". CloudEvents 1.0
	// requires one on every event. Default: "/" +
	// $MILLWRIGHT_SERVICE_NAME (EnvServiceName), read by NewWriter; without
	// it "/" + the program's file name (os.Args[0]), valid but saying
	// little: name your service.
	Source string
}

// Validate reports what is wrong with c, naming the setting.
func (c WriterConfig) Validate() error {
	if c.MaxEventBytes < -1 {
		return fmt.Errorf("outbox: WriterConfig.MaxEventBytes is %d: want a byte count above 0, 0 for Limits.MaxBytes, or -1 for no size limit", c.MaxEventBytes)
	}
	if c.Source != "" {
		if err := checkSource(c.Source); err != nil {
			return fmt.Errorf("outbox: WriterConfig.Source: %w", err)
		}
	}
	return nil
}

// Writer writes events to the outbox, checked against the limits of the
// relay's transport and with its default source, both fixed when it is
// built. It holds no connection: its methods write through the
// transaction they are given. A Writer is safe for concurrent use, and
// two Writers with different settings may live in one process. A nil
// *Writer is the default Writer, the one of the package-level Add and
// AddToBatch (WriterConfig's defaults).
type Writer struct {
	limits transport.Limits
	source string
}

// NewWriter returns a Writer with cfg's settings (see WriterConfig for
// the defaults), or an error naming the setting that is wrong.
func NewWriter(cfg WriterConfig) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return newWriter(cfg), nil
}

// newWriter is NewWriter after validation.
func newWriter(cfg WriterConfig) *Writer {
	w := &Writer{limits: cfg.Limits, source: cfg.Source}
	if w.limits == (transport.Limits{}) {
		w.limits = transport.DefaultLimits("")
	}
	switch {
	case cfg.MaxEventBytes > 0:
		w.limits.MaxBytes = cfg.MaxEventBytes
		w.limits.Setting = "outbox.WriterConfig.MaxEventBytes"
	case cfg.MaxEventBytes == -1:
		w.limits.MaxBytes = 0
	}
	if w.source == "" {
		w.source = sourceFromName(os.Getenv(EnvServiceName))
	}
	return w
}

// defaultWriter is the Writer of the package-level Add, built on its first
// use ($MILLWRIGHT_SERVICE_NAME is read once).
var defaultWriter = sync.OnceValue(func() *Writer { return newWriter(WriterConfig{}) })

// or returns w, or the default Writer when w is nil.
func (w *Writer) or() *Writer {
	if w == nil {
		return defaultWriter()
	}
	return w
}

// Limits returns the limits w checks events against: WriterConfig.Limits
// after defaults, with MaxBytes from WriterConfig.MaxEventBytes when set.
func (w *Writer) Limits() transport.Limits { return w.or().limits }

// Source returns the CloudEvents source w gives events written without
// Event.Source.
func (w *Writer) Source() string { return w.or().source }

// Add writes events to the outbox in tx, the caller's transaction: they
// are published if and only if it commits. It is the package-level Add
// (see there for what it fills in and how it writes) with w's limits and
// source.
func (w *Writer) Add(ctx context.Context, tx postgres.Tx, events ...Event) (err error) {
	ctx, span := tracing.StartWriteSpan(ctx, len(events))
	defer func() { tracing.EndSpan(span, err) }()
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("outbox: Writer.Add: %w: pass the transaction (postgres.PgxTx(tx) or postgres.SQLTx(tx)) the events belong to", err)
	}
	return w.or().add(ctx, q, events)
}

// AddToBatch queues the INSERT of events into b, as the package-level
// AddToBatch does (see there), with w's limits and source.
func (w *Writer) AddToBatch(ctx context.Context, b *pgx.Batch, events ...Event) (err error) {
	ctx, span := tracing.StartWriteSpan(ctx, len(events))
	defer func() { tracing.EndSpan(span, err) }()
	return w.or().addToBatch(ctx, b, events)
}

// AddOutsideTx writes events to the outbox in a transaction of its own on
// db, as the package-level AddOutsideTx does (see there), with w's limits
// and source.
func (w *Writer) AddOutsideTx(ctx context.Context, db postgres.DB, events ...Event) error {
	return db.InTx(ctx, func(tx postgres.Tx) error { return w.Add(ctx, tx, events...) })
}
