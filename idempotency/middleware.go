package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/metadata"
)

// Mode chooses when the processed mark is written.
type Mode int

const (
	// Transactional writes the mark first, in a transaction that the handler
	// shares (TxFromContext), and commits
	// both after the handler succeeds.
	// Effects written through that transaction happen exactly once, and so
	// do the outbox rows of produced messages with Config.ProducedToOutbox.
	// The default.
	Transactional Mode = iota
	// MarkAfterSuccess checks for a mark, runs the handler with no
	// transaction held, then writes the mark. For handlers whose effect is
	// outside the database (an HTTP call). The effect is at least once: see
	// the package documentation for the windows in which it repeats.
	MarkAfterSuccess
)

// String returns the mode's name.
func (m Mode) String() string {
	switch m {
	case Transactional:
		return "transactional"
	case MarkAfterSuccess:
		return "mark-after-success"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// ErrNoEventID is returned by the middleware, wrapped in failure.Permanent,
// for a message that has no event id: neither the metadata.EventID key nor
// Config.KeyFunc gave one. Such a message cannot be deduplicated, so it is
// not processed and not acked; retrying cannot help, so the retry middleware
// stops at once and the dead-letter path parks it with this reason. Test
// with errors.Is(err, ErrNoEventID).
var ErrNoEventID = errors.New("message has no event id")

// ErrInvalidEventID is returned by the middleware, wrapped in
// failure.Permanent, for a message whose event id cannot be stored: longer
// than MaxEventIDBytes, not valid UTF-8, or holding a NUL byte. Such a
// message is not processed; the dead-letter path parks it. Test with
// errors.Is(err, ErrInvalidEventID); the error also matches ErrNoEventID
// (the message has no usable id).
var ErrInvalidEventID = errors.New("invalid event id")

// MaxEventIDBytes bounds an event id. Postgres cannot index a key above
// about 2,700 bytes (a third of a page), so a longer id would fail on every
// redelivery; 1,024 leaves room for the consumer name and is far above any
// UUID, ULID or "order-123:created" id.
const MaxEventIDBytes = 1024

// KeyFunc derives an event id from a message that lacks the metadata.EventID
// key. It returns "" (or an error) when the message has no usable id.
type KeyFunc func(msg *message.Message) (string, error)

// KeyFromUUID is a KeyFunc that uses Watermill's message UUID. It only
// deduplicates redeliveries of one published message: a producer that
// publishes the same event twice with fresh UUIDs defeats it.
func KeyFromUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// Metric names, each with a "consumer" label.
const (
	// MetricDuplicates counts messages skipped because the consumer had
	// already processed their event.
	MetricDuplicates = "millwright_idempotency_duplicates_total"
	// MetricProcessed counts messages whose handler ran and whose mark was
	// committed.
	MetricProcessed = "millwright_idempotency_processed_total"
	// MetricRepeatedEffects counts, in MarkAfterSuccess mode, handler runs
	// that found the mark already written when they finished: two deliveries
	// ran at once and the effect happened twice.
	MetricRepeatedEffects = "millwright_idempotency_repeated_effects_total"
)

// Config configures a Middleware.
type Config struct {
	// Consumer names the consuming service or handler; marks are scoped by
	// it, so two consumers of one event each process it once. Required.
	// Keep it stable across deploys: renaming it reprocesses every event.
	Consumer string
	// Mode chooses when the mark is written. Default Transactional.
	Mode Mode
	// KeyFunc gives the event id of a message without the metadata.EventID
	// key. Default nil: such a message fails with ErrNoEventID.
	KeyFunc KeyFunc
	// Registerer receives the middleware's counters. Default nil: none
	// registered, as in every millwright component (Stats reads the counts
	// without Prometheus); pass prometheus.DefaultRegisterer for the
	// global registry. Middlewares sharing a Registerer share the counters
	// (told apart by the consumer label).
	Registerer prometheus.Registerer
	// Logger logs duplicates (debug) and repeated effects (error).
	// Default watermill.NopLogger.
	Logger watermill.LoggerAdapter

	// The messages a handler returns (Watermill's produced messages) are
	// sent by the middleware, before the mark commits, to the destination
	// named here, and the middleware returns none to the router: the
	// router would publish them after the commit, and a failed publish
	// would then lose them (the redelivery is a duplicate and is skipped).
	// With neither ProducedToOutbox nor ProducedPublisher set, a handler
	// that returns messages fails with ErrNoProducedDestination. Handlers
	// that return no messages need neither.

	// ProducedToOutbox writes the produced messages to the outbox (package
	// outbox) of the store's database, in the unit of work that writes the
	// mark; an outbox relay on that database publishes them (apply
	// outbox.Migrations() there). In Transactional mode that is
	// the handler's own transaction: effects, mark and follow-ups commit
	// together or not at all. In MarkAfterSuccess mode it is the mark's
	// transaction: follow-ups and mark commit together. Each message
	// becomes an event as outbox.TxPublisher makes it (its UUID is the
	// event id). Needs a PostgresStore. Default false. Excludes
	// ProducedPublisher.
	ProducedToOutbox bool
	// ProducedPublisher publishes the produced messages before the mark
	// commits, on any store. When Publish fails the message fails: the
	// mark is not committed (in Transactional mode the handler's effects
	// roll back with it) and the redelivery runs the handler again, so
	// follow-ups are at least once (a copy may also go out when the commit
	// fails after the publish). A message without metadata.EventID gets one
	// derived from (Consumer, the consumed event id, its index), so every
	// copy has the same id and a downstream idempotency middleware drops
	// the extra ones. Publish holds the Transactional mode's transaction
	// (a connection and the mark's row lock) while it runs. Default nil.
	// Excludes ProducedToOutbox.
	ProducedPublisher message.Publisher
	// ProducedTopic is the topic the produced messages go to. Default "":
	// the router handler's publish topic (the publishTopic of
	// Router.AddHandler, read with message.PublishTopicFromCtx); with none,
	// a handler that returns messages fails with ErrNoProducedDestination.
	// Only with ProducedToOutbox or ProducedPublisher.
	ProducedTopic string
}

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, naming it.
func (c Config) Validate() error {
	var errs []error
	if c.Consumer == "" {
		errs = append(errs, errors.New(`idempotency: Config.Consumer is empty: set it to the consuming service's stable name, e.g. "billing.order-created"`))
	}
	if c.Mode != Transactional && c.Mode != MarkAfterSuccess {
		errs = append(errs, fmt.Errorf("idempotency: invalid Config.Mode %d: want Transactional or MarkAfterSuccess", int(c.Mode)))
	}
	if c.ProducedToOutbox && c.ProducedPublisher != nil {
		errs = append(errs, errors.New("idempotency: Config.ProducedToOutbox and Config.ProducedPublisher are both set: set one (the outbox, written with the mark, is the stronger)"))
	}
	if c.ProducedTopic != "" && !c.ProducedToOutbox && c.ProducedPublisher == nil {
		errs = append(errs, fmt.Errorf("idempotency: Config.ProducedTopic %q is set but no destination is: set Config.ProducedToOutbox or Config.ProducedPublisher", c.ProducedTopic))
	}
	return errors.Join(errs...)
}

// Middleware deduplicates messages by event id for one consumer. It is safe
// for concurrent use, also by several routers.
type Middleware struct {
	store    Store
	cfg      Config
	dups     prometheus.Counter
	done     prometheus.Counter
	repeated prometheus.Counter
	stats    struct{ processed, duplicates, repeated atomic.Uint64 }
}

// Stats is a snapshot of one middleware's counts since NewMiddleware, the
// same events its Prometheus counters count.
type Stats struct {
	// Processed counts messages whose handler ran and whose mark
	// committed (MetricProcessed).
	Processed uint64
	// Duplicates counts messages skipped as already processed
	// (MetricDuplicates).
	Duplicates uint64
	// RepeatedEffects counts MarkAfterSuccess runs that found the mark
	// already written: the effect happened twice (MetricRepeatedEffects).
	RepeatedEffects uint64
}

// Stats returns the middleware's counts. It takes no lock and needs no
// Registerer; it is safe for concurrent use.
func (m *Middleware) Stats() Stats {
	return Stats{Processed: m.stats.processed.Load(), Duplicates: m.stats.duplicates.Load(), RepeatedEffects: m.stats.repeated.Load()}
}

// NewMiddleware returns a middleware that records processed events in store.
func NewMiddleware(store Store, cfg Config) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("idempotency: NewMiddleware: store is nil; pass NewPostgresStore(db) or NewMemoryStore()")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if _, ok := store.(*MemoryStore); ok && cfg.ProducedToOutbox {
		return nil, errors.New("idempotency: NewMiddleware: Config.ProducedToOutbox needs a PostgresStore (the outbox is written in its transaction), not a MemoryStore: use NewPostgresStore, or set Config.ProducedPublisher instead in unit tests")
	}
	m := &Middleware{store: store, cfg: cfg}
	var err error
	if m.dups, err = counter(cfg, MetricDuplicates, "Messages skipped because the consumer had already processed their event."); err != nil {
		return nil, err
	}
	if m.done, err = counter(cfg, MetricProcessed, "Messages processed with their mark committed."); err != nil {
		return nil, err
	}
	if m.repeated, err = counter(cfg, MetricRepeatedEffects, "MarkAfterSuccess handler runs whose event had been marked meanwhile: the effect happened twice."); err != nil {
		return nil, err
	}
	return m, nil
}

func counter(cfg Config, name, help string) (prometheus.Counter, error) {
	if cfg.Registerer == nil {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help}), nil
	}
	vec, err := promreg.Register(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"consumer"}))
	if err != nil {
		return nil, fmt.Errorf("idempotency: registering metric %s: %w", name, err)
	}
	return vec.WithLabelValues(cfg.Consumer), nil
}

// EventID returns the id the middleware deduplicates msg by: the
// metadata.EventID value, else Config.KeyFunc's. When there is none the
// error wraps ErrNoEventID and is marked failure.Permanent.
func (m *Middleware) EventID(msg *message.Message) (string, error) {
	if id := msg.Metadata.Get(metadata.EventID); id != "" {
		return m.checkEventID(msg, id, "metadata "+metadata.EventID)
	}
	if m.cfg.KeyFunc != nil {
		id, err := m.cfg.KeyFunc(msg)
		if err != nil {
			return "", failure.Permanent(fmt.Errorf("idempotency: consumer %q: message %s: KeyFunc: %w (%w)", m.cfg.Consumer, msg.UUID, err, ErrNoEventID))
		}
		if id != "" {
			return m.checkEventID(msg, id, "Config.KeyFunc's id")
		}
	}
	return "", failure.Permanent(fmt.Errorf("idempotency: consumer %q: message %s: %w: set the %q metadata key when publishing (the outbox does) or configure Config.KeyFunc",
		m.cfg.Consumer, msg.UUID, ErrNoEventID, metadata.EventID))
}

// checkEventID refuses an id no store can keep, permanently: retrying
// cannot change it. The error quotes at most 64 bytes of it.
func (m *Middleware) checkEventID(msg *message.Message, id, from string) (string, error) {
	var problem string
	switch {
	case len(id) > MaxEventIDBytes:
		problem = fmt.Sprintf("is %d bytes long: want at most %d", len(id), MaxEventIDBytes)
	case !utf8.ValidString(id):
		problem = "is not valid UTF-8"
	case strings.IndexByte(id, 0) >= 0:
		problem = "holds a NUL byte"
	default:
		return id, nil
	}
	shown := id
	if len(shown) > 64 {
		shown = strings.ToValidUTF8(shown[:64], "") + "..."
	}
	return "", failure.Permanent(fmt.Errorf("idempotency: consumer %q: message %s: %s %q %s: %w (%w)",
		m.cfg.Consumer, msg.UUID, from, shown, problem, ErrInvalidEventID, ErrNoEventID))
}

// Middleware wraps h so that each event is processed once by this consumer.
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	if m.cfg.Mode == MarkAfterSuccess {
		return func(msg *message.Message) ([]*message.Message, error) { return m.markAfter(h, msg) }
	}
	return func(msg *message.Message) ([]*message.Message, error) { return m.transactional(h, msg) }
}

func (m *Middleware) transactional(h message.HandlerFunc, msg *message.Message) (_ []*message.Message, err error) {
	id, err := m.EventID(msg)
	if err != nil {
		return nil, err
	}
	ctx := msg.Context()
	tx, fresh, err := m.beginMark(ctx, id)
	if err != nil {
		return nil, err
	}
	committed := false
	defer func() {
		// Also runs when the handler panics, so the connection and any
		// row lock go back at once.
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if !fresh {
		m.duplicate(msg, id)
		return nil, nil
	}

	msg.SetContext(withTx(ctx, tx))
	produced, err := func() ([]*message.Message, error) {
		defer msg.SetContext(ctx) // Watermill #467: later middlewares and retries see the original context
		return h(msg)
	}()
	if err != nil {
		return nil, err
	}
	if err := m.sendProduced(ctx, id, tx, produced); err != nil {
		return nil, err // the deferred Rollback undoes mark and effects: the redelivery runs the handler again
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("idempotency: consumer %q event %q: handler succeeded but its transaction did not commit, the message will be redelivered: %w",
			m.cfg.Consumer, id, err)
	}
	committed = true
	m.done.Inc()
	m.stats.processed.Add(1)
	return nil, nil // sent above, before the commit; never to the router
}

// beginMark begins the message's unit of work and writes its mark: in one
// step when the store can (BeginMarker), else Begin then Mark. On error no
// unit of work is left open.
func (m *Middleware) beginMark(ctx context.Context, id string) (Tx, bool, error) {
	if bm, ok := m.store.(BeginMarker); ok {
		return bm.BeginMark(ctx, m.cfg.Consumer, id)
	}
	tx, err := m.store.Begin(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("idempotency: consumer %q event %q: %w", m.cfg.Consumer, id, err)
	}
	fresh, err := tx.Mark(ctx, m.cfg.Consumer, id)
	if err != nil {
		_ = tx.Rollback()
		return nil, false, err
	}
	return tx, fresh, nil
}

func (m *Middleware) markAfter(h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	id, err := m.EventID(msg)
	if err != nil {
		return nil, err
	}
	ctx := msg.Context()
	seen, err := m.store.Processed(ctx, m.cfg.Consumer, id)
	if err != nil {
		return nil, err
	}
	if seen {
		m.duplicate(msg, id)
		return nil, nil
	}
	produced, err := h(msg)
	if err != nil {
		return nil, err
	}

	var fresh bool
	if m.cfg.ProducedToOutbox && len(produced) > 0 {
		fresh, err = m.markWithProduced(ctx, id, produced)
	} else {
		if err := m.sendProduced(ctx, id, nil, produced); err != nil {
			return nil, err // no mark: the redelivery runs the handler (and its effect) again
		}
		fresh, err = m.markAlone(ctx, id)
	}
	if err != nil {
		return nil, fmt.Errorf("idempotency: consumer %q event %q: handler succeeded but the mark could not be written, the redelivery will run it again: %w",
			m.cfg.Consumer, id, err)
	}
	if !fresh {
		m.repeated.Inc()
		m.stats.repeated.Add(1)
		fields := watermill.LogFields{"consumer": m.cfg.Consumer, "event_id": id, "mode": m.cfg.Mode.String()}
		if m.cfg.ProducedToOutbox && len(produced) > 0 {
			// The first delivery's follow-ups committed with its mark.
			fields["produced_not_written"] = len(produced)
		}
		m.cfg.Logger.Error("Event processed twice: another delivery finished first", nil, logfields.Of("", msg).Add(fields))
		return nil, nil
	}
	m.done.Inc()
	m.stats.processed.Add(1)
	return nil, nil // sent above, before the mark; never to the router
}

// markAlone writes one mark in a unit of work of its own.
func (m *Middleware) markAlone(ctx context.Context, id string) (bool, error) {
	if mk, ok := m.store.(Marker); ok {
		return mk.Mark(ctx, m.cfg.Consumer, id)
	}
	tx, err := m.store.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	fresh, err := tx.Mark(ctx, m.cfg.Consumer, id)
	if err != nil {
		return false, err
	}
	return fresh, tx.Commit()
}

func (m *Middleware) duplicate(msg *message.Message, id string) {
	m.dups.Inc()
	m.stats.duplicates.Add(1)
	m.cfg.Logger.Debug("Skipping duplicate event", logfields.Of("", msg).Add(watermill.LogFields{
		"consumer": m.cfg.Consumer, "event_id": id,
	}))
}
