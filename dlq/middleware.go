package dlq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/internal/promreg"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// Dead-letter reasons: the metadata.DeadLetterReason value, the reason
// column and the "reason" label of MetricDeadLetters.
const (
	// ReasonExhausted: every attempt the retry policy allowed failed.
	ReasonExhausted = "exhausted"
	// ReasonPermanent: the handler returned a failure.Permanent error.
	ReasonPermanent = "permanent"
	// ReasonMalformed: the handler returned a Malformed error.
	ReasonMalformed = "malformed"
	// ReasonPanic: the retries are exhausted and the last attempt panicked.
	ReasonPanic = "panic"
	// ReasonSkipped: an operator skipped a parked key's head before park
	// gave up on it (park.SkipTx, `millwright parked skip`).
	ReasonSkipped = "skipped"
)

// Metric names.
const (
	// MetricDeadLetters counts messages published to a dead-letter topic, by
	// original topic and reason.
	MetricDeadLetters = "millwright_dlq_dead_letters_total"
	// MetricPublishFailures counts dead-letter publishes that failed (the
	// original message was nacked for redelivery), by original topic.
	MetricPublishFailures = "millwright_dlq_publish_failures_total"
	// MetricDepth is the number of dead letters stored and not yet
	// replayed, by original topic. See NewDepthCollector. (MetricReplaysSkipped
	// is with ReplayGate.)
	MetricDepth = "millwright_dlq_depth_messages"
)

// DefaultTopic is the default Config.Topic: the subscribe topic with a
// ".dlq" suffix.
func DefaultTopic(topic string) string { return topic + ".dlq" }

// DefaultMaxValueBytes is the default Config.MaxValueBytes: the Google Cloud
// Pub/Sub limit on an attribute value, the smallest of the transports.
const DefaultMaxValueBytes = 1024

// Config configures the dead-letter middleware. Only the publisher (an
// argument of NewMiddleware) is required.
type Config struct {
	// Topic maps the topic a message was consumed from to its dead-letter
	// topic. Default DefaultTopic ("orders" -> "orders.dlq"). It must not
	// return "".
	Topic func(topic string) string
	// ConsumerGroup is recorded on every dead letter
	// (metadata.DeadLetterConsumerGroup) and, with the Watermill handler
	// name, names the consumer a replay of it is for: the middleware acks
	// a replay for another consumer without running the handler (see
	// ReplayGate). Default "": not known; set it (the consumer group the
	// subscriber uses) so that two services whose handlers share a name
	// are not one consumer to a replay.
	ConsumerGroup string
	// Retry is the retry policy applied inside the middleware, before a
	// message is dead-lettered. Zero fields take retry's defaults (5
	// attempts). MaxAttempts 1 disables retries.
	Retry retry.Policy
	// Logger receives one Error line per dead letter and per failed
	// dead-letter publish, and the retry middleware's lines. Default
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Registerer registers MetricDeadLetters, MetricPublishFailures,
	// MetricReplaysSkipped and retry.MetricRetries. Default nil: no
	// metrics.
	Registerer prometheus.Registerer
	// MaxValueBytes truncates the error and stack values written to
	// metadata, so the dead letter fits the transport's header limits.
	// Default DefaultMaxValueBytes (1024); -1 means no limit (Kafka, AMQP
	// and SQL take values of many kilobytes).
	MaxValueBytes int
	// OnRetry is passed to the retry middleware (see retry.Config.OnRetry).
	OnRetry func(msg *message.Message, attempt int, err error, delay time.Duration)
	// PublishTimeout bounds the dead-letter publish: the dead letter's
	// context carries this deadline, and a publisher that does not stop at
	// it (a broker that stopped confirming) is left behind after it. The
	// message is then nacked for redelivery, as after a failed publish, so
	// the handler's slot is never held forever. Default
	// DefaultPublishTimeout (30s); -1 means no bound.
	PublishTimeout time.Duration
}

// DefaultPublishTimeout is the default of Config.PublishTimeout.
const DefaultPublishTimeout = 30 * time.Second

func (c *Config) setDefaults() {
	if c.Topic == nil {
		c.Topic = DefaultTopic
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if _, nop := c.Logger.(watermill.NopLogger); !nop {
		// Handler errors often quote a DSN or URL with its password.
		c.Logger = redact.Logger(c.Logger)
	}
	if c.MaxValueBytes == 0 {
		c.MaxValueBytes = DefaultMaxValueBytes
	}
	c.Retry = c.Retry.WithDefaults()
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	var errs []error
	if err := c.Retry.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("dlq: invalid Config.Retry: %w", err))
	}
	if c.Retry.MaxAttempts < 0 && c.Retry.MaxElapsedTime == 0 {
		errs = append(errs, errors.New("dlq: Config.Retry has no limit (MaxAttempts -1, MaxElapsedTime 0): a poison message would be retried forever and block its queue; set MaxAttempts or MaxElapsedTime"))
	}
	if c.PublishTimeout < -1 {
		errs = append(errs, fmt.Errorf("dlq: Config.PublishTimeout %s: want > 0, or -1 for no bound", c.PublishTimeout))
	}
	if c.MaxValueBytes < -1 || (c.MaxValueBytes >= 0 && c.MaxValueBytes < 64) {
		errs = append(errs, fmt.Errorf("dlq: Config.MaxValueBytes %d: want >= 64, or -1 for no limit", c.MaxValueBytes))
	}
	return errors.Join(errs...)
}

// Middleware is the one composition of panic recovery, retry and dead
// lettering. Create it with NewMiddleware and add its Middleware method to a
// router or handler. Safe for concurrent use.
type Middleware struct {
	pub            message.Publisher
	cfg            Config
	retry          *retry.Middleware
	deadLetters    *prometheus.CounterVec
	publishFailure *prometheus.CounterVec
	replays        *ReplayGate
	stats          struct{ deadLetters, publishFailures, exhausted, permanent, malformed, panics atomic.Uint64 }
}

// Stats is a snapshot of one middleware's counts since NewMiddleware, the
// same events its Prometheus counters count.
type Stats struct {
	// DeadLetters counts messages published to a dead-letter topic
	// (MetricDeadLetters), all reasons.
	DeadLetters uint64
	// ByReason splits DeadLetters by reason (ReasonExhausted,
	// ReasonPermanent, ReasonMalformed, ReasonPanic); reasons never seen
	// are absent.
	ByReason map[string]uint64
	// PublishFailures counts dead-letter publishes that failed; those
	// messages were nacked for redelivery (MetricPublishFailures).
	PublishFailures uint64
	// ReplaysSkipped counts replayed dead letters acked without running
	// the handler because they were for another consumer
	// (MetricReplaysSkipped).
	ReplaysSkipped uint64
}

// Stats returns the middleware's counts. It takes no lock and needs no
// Registerer; it is safe for concurrent use.
func (m *Middleware) Stats() Stats {
	s := Stats{DeadLetters: m.stats.deadLetters.Load(), PublishFailures: m.stats.publishFailures.Load(), ByReason: map[string]uint64{},
		ReplaysSkipped: m.replays.Skipped()}
	for _, r := range [...]struct {
		reason string
		n      *atomic.Uint64
	}{{ReasonExhausted, &m.stats.exhausted}, {ReasonPermanent, &m.stats.permanent}, {ReasonMalformed, &m.stats.malformed}, {ReasonPanic, &m.stats.panics}} {
		if n := r.n.Load(); n > 0 {
			s.ByReason[r.reason] = n
		}
	}
	return s
}

// countDeadLetter records one dead letter of reason in Stats.
func (m *Middleware) countDeadLetter(reason string) {
	m.stats.deadLetters.Add(1)
	switch reason {
	case ReasonExhausted:
		m.stats.exhausted.Add(1)
	case ReasonPermanent:
		m.stats.permanent.Add(1)
	case ReasonMalformed:
		m.stats.malformed.Add(1)
	case ReasonPanic:
		m.stats.panics.Add(1)
	}
}

// NewMiddleware returns the dead-letter middleware, with retries inside it:
//
//	recover -> dead-letter -> retry (recovering each attempt) -> handler
//
// The retry runs innermost so the dead-letter step sees only the final
// outcome; panics are recovered on every attempt (and once more around the
// dead-letter step itself). Do not add retry.Middleware, Watermill's Retry,
// Recoverer or PoisonQueue around or inside it: it already does their work.
//
// pub publishes the dead letters; it may be the same publisher the service
// uses, and must outlive the router (close it after the router has drained).
func NewMiddleware(pub message.Publisher, cfg Config) (*Middleware, error) {
	if pub == nil {
		return nil, errors.New("dlq: NewMiddleware needs a message.Publisher for the dead-letter topics, got nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rm, err := retry.NewMiddleware(retry.Config{
		Policy: cfg.Retry, Logger: cfg.Logger, Registerer: cfg.Registerer, OnRetry: cfg.OnRetry,
		SilentGiveUp: true, // we log one line per dead letter (or failed publish) instead
	})
	if err != nil {
		return nil, err
	}
	m := &Middleware{pub: pub, cfg: cfg, retry: rm}
	if m.replays, err = NewReplayGate(cfg.ConsumerGroup, cfg.Logger, cfg.Registerer); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		if m.deadLetters, err = registerCounter(cfg.Registerer, MetricDeadLetters,
			"Messages published to a dead-letter topic, by original topic and reason.", "topic", "reason"); err != nil {
			return nil, err
		}
		if m.publishFailure, err = registerCounter(cfg.Registerer, MetricPublishFailures,
			"Dead-letter publishes that failed; the original message was nacked for redelivery.", "topic"); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func registerCounter(reg prometheus.Registerer, name, help string, labels ...string) (*prometheus.CounterVec, error) {
	cv, err := promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels))
	if err != nil {
		return nil, fmt.Errorf("dlq: registering metric %s: %w", name, err)
	}
	return cv, nil
}

// Middleware wraps h. Its shape is message.HandlerMiddleware.
//
// It returns nil (ack) when h succeeds, when the message was published to
// its dead-letter topic, or, without running h, when the message is a
// replayed dead letter for another consumer (its
// metadata.DeadLetterReplayFor names another consumer group or handler:
// see ReplayGate); it returns an error (nack, redelivery) when the
// retries were interrupted by the message's context ending, when the
// dead-letter publish failed, or when the message is itself a dead letter
// consumed from its dead-letter topic (a failing recorder does not park
// dead letters on "<topic>.dlq.dlq").
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	inner := m.retry.Middleware(h)
	return func(msg *message.Message) (produced []*message.Message, err error) {
		defer func() {
			// Only the dead-letter step itself can panic here (the retry
			// recovers the handler's panics); nack so nothing is lost.
			if r := recover(); r != nil {
				produced = nil
				err = fmt.Errorf("dlq: panic while dead-lettering message %s, nacked: %v", msg.UUID, r)
			}
		}()
		if m.replays.Skip(msg, message.HandlerNameFromCtx(msg.Context())) {
			return nil, nil
		}
		produced, err = inner(msg)
		if err == nil {
			return produced, nil
		}
		if !retry.Final(err) {
			return nil, err
		}
		if isDeadLetter(msg) {
			// A dead letter that cannot be handled (the recorder's database
			// is down) is nacked, not parked on "<topic>.dlq.dlq" where
			// nobody looks: it stays on its dead-letter topic.
			m.cfg.Logger.Error("Handling a dead letter failed; nacked, not dead-lettered again", err, watermill.LogFields{
				"message_uuid": msg.UUID,
				"topic":        message.SubscribeTopicFromCtx(msg.Context()),
			})
			return nil, err
		}
		if perr := m.deadLetter(msg, err); perr != nil {
			return nil, errors.Join(err, perr)
		}
		return nil, nil
	}
}

// deadLetter publishes msg to its dead-letter topic with the failure's
// context in its metadata.
func (m *Middleware) deadLetter(msg *message.Message, cause error) error {
	ctx := msg.Context()
	topic := message.SubscribeTopicFromCtx(ctx)
	dlTopic := m.cfg.Topic(topic)
	if dlTopic == "" {
		return fmt.Errorf("dlq: Config.Topic returned an empty dead-letter topic for topic %q (message %s nacked): return a topic name", topic, msg.UUID)
	}
	now := time.Now()
	f := Failure{Attempts: 1, FirstFailure: now, LastFailure: now}
	var re *retry.Error
	if errors.As(cause, &re) {
		f.Attempts, f.FirstFailure, f.LastFailure = re.Attempts, re.FirstFailure, re.LastFailure
	}
	f.Reason, f.Error, f.ErrorType, f.Stack = classify(cause)

	dl := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if !isDeadLetterKey(k) {
			dl.Metadata[k] = v
		}
	}
	md := dl.Metadata
	md.Set(metadata.DeadLetterOriginalTopic, topic)
	md.Set(metadata.DeadLetterTopic, dlTopic)
	md.Set(metadata.DeadLetterConsumerGroup, m.cfg.ConsumerGroup)
	md.Set(metadata.DeadLetterHandler, message.HandlerNameFromCtx(ctx))
	md.Set(metadata.DeadLetterReason, f.Reason)
	md.Set(metadata.DeadLetterError, truncate(f.Error, m.cfg.MaxValueBytes))
	md.Set(metadata.DeadLetterErrorType, f.ErrorType)
	if f.Stack != "" {
		md.Set(metadata.DeadLetterStack, truncate(f.Stack, m.cfg.MaxValueBytes))
	}
	md.Set(metadata.DeadLetterAttempts, strconv.Itoa(f.Attempts))
	md.Set(metadata.DeadLetterFirstFailure, f.FirstFailure.UTC().Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterLastFailure, f.LastFailure.UTC().Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterOriginalMessageID, msg.UUID)
	// Keep the context's values (trace spans) but not its cancellation: the
	// decision to park was made, and a shutdown starting now should not turn
	// it into a redelivery of a message that already used its attempts.
	dlCtx := context.WithoutCancel(ctx)
	if m.cfg.PublishTimeout > 0 {
		var cancel context.CancelFunc
		dlCtx, cancel = context.WithTimeout(dlCtx, m.cfg.PublishTimeout)
		defer cancel()
	}
	dl.SetContext(dlCtx)

	fields := logfields.Of(topic, msg).Add(watermill.LogFields{
		"dlq_topic":  dlTopic,
		"handler":    message.HandlerNameFromCtx(ctx),
		"reason":     f.Reason,
		"attempts":   f.Attempts,
		"error_type": f.ErrorType,
	})
	if err := m.publish(dlCtx, dlTopic, dl); err != nil {
		m.stats.publishFailures.Add(1)
		if m.publishFailure != nil {
			m.publishFailure.WithLabelValues(topic).Inc()
		}
		m.cfg.Logger.Error("Dead-letter publish failed; message nacked for redelivery", err, fields)
		return fmt.Errorf("dlq: publishing message %s to dead-letter topic %q failed, message nacked for redelivery (check the publisher/broker): %w", msg.UUID, dlTopic, err)
	}
	m.countDeadLetter(f.Reason)
	if m.deadLetters != nil {
		m.deadLetters.WithLabelValues(topic, f.Reason).Inc()
	}
	m.cfg.Logger.Error("Message dead-lettered", cause, fields)
	return nil
}

// Failure is what the middleware records about a dead-lettered message.
type Failure struct {
	// Reason is one of the Reason constants.
	Reason string
	// Error is the text of the handler's last error, without the retry
	// wrapper's attempt count.
	Error string
	// ErrorType is the Go type of that error, e.g. "*json.SyntaxError".
	ErrorType string
	// Stack is the panic's stack when the last attempt panicked.
	Stack string
	// Attempts counts the attempts made.
	Attempts int
	// FirstFailure and LastFailure are when the first and last attempts failed.
	FirstFailure, LastFailure time.Time
}

// classify finds the handler's own error under millwright's wrappers and
// derives the reason.
func classify(err error) (reason, text, typ, stack string) {
	cause := err
	for {
		var next error
		switch e := cause.(type) {
		case *retry.Error:
			next = e.Err
		case *failure.PermanentError:
			next = e.Err
		case *MalformedError:
			next = e.Err
		}
		if next == nil {
			break
		}
		cause = next
	}
	var pe *retry.PanicError
	isPanic := errors.As(err, &pe)
	switch {
	case IsMalformed(err):
		reason = ReasonMalformed
	case failure.IsPermanent(err):
		reason = ReasonPermanent
	case isPanic:
		reason = ReasonPanic
	default:
		reason = ReasonExhausted
	}
	if isPanic {
		stack = pe.Stack()
	}
	// Handler errors often quote a DSN or URL with its password (net/url
	// and lib/pq put the whole URL in parse errors); a dead letter is read
	// by many more people than the service's configuration.
	text = redact.Text(cause.Error())
	stack = redact.Text(stack)
	if IsMalformed(err) {
		text = "malformed message: " + text
	}
	return reason, text, typeName(cause), stack
}

// typeName names the Go type of err, looking through fmt.Errorf's plain
// wrapping (whose type, *fmt.wrapError, says nothing) to the error it wraps.
func typeName(err error) string {
	for {
		name := fmt.Sprintf("%T", err)
		if name != "*fmt.wrapError" {
			return name
		}
		next := errors.Unwrap(err)
		if next == nil {
			return name
		}
		err = next
	}
}

// isDeadLetter reports whether msg was consumed from the dead-letter topic
// the middleware published it to.
func isDeadLetter(msg *message.Message) bool {
	dl := msg.Metadata.Get(metadata.DeadLetterTopic)
	return dl != "" && dl == message.SubscribeTopicFromCtx(msg.Context())
}

func isDeadLetterKey(k string) bool {
	return len(k) >= len(metadata.DeadLetterPrefix) && k[:len(metadata.DeadLetterPrefix)] == metadata.DeadLetterPrefix
}

// truncate cuts s to at most max bytes (on a rune boundary), saying how much
// was cut; max -1 means no limit.
func truncate(s string, max int) string {
	if max < 0 || len(s) <= max {
		return s
	}
	const marker = "…[truncated]"
	cut := max - len(marker)
	for cut > 0 && cut < len(s) && s[cut]&0xC0 == 0x80 {
		cut--
	}
	return s[:cut] + marker
}

// publish publishes the dead letter, returning when ctx is done even if
// the publisher does not (it is left to finish on its own).
func (m *Middleware) publish(ctx context.Context, topic string, dl *message.Message) error {
	if m.cfg.PublishTimeout <= 0 {
		return m.pub.Publish(topic, dl)
	}
	done := make(chan error, 1)
	go func() { done <- m.pub.Publish(topic, dl) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("no answer within Config.PublishTimeout (%s); the publish is left to finish: %w", m.cfg.PublishTimeout, ctx.Err())
	}
}

// Describe returns what the middleware would record about a message whose
// handler failed with err: the reason, the handler's own error (redacted,
// under millwright's wrappers), its Go type, the panic stack, and the
// attempt count and failure times of a *retry.Error (else one attempt,
// failing now). Other dead-lettering components (package park) use it so
// that their dead letters read like the middleware's.
func Describe(err error) Failure {
	now := time.Now()
	f := Failure{Attempts: 1, FirstFailure: now, LastFailure: now}
	var re *retry.Error
	if errors.As(err, &re) {
		f.Attempts, f.FirstFailure, f.LastFailure = re.Attempts, re.FirstFailure, re.LastFailure
	}
	f.Reason, f.Error, f.ErrorType, f.Stack = classify(err)
	return f
}
