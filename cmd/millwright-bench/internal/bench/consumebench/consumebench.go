// Package consumebench is `millwright-bench consume`: consumer throughput
// on a real Kafka broker, millwright's key-parallel consumer
// (kafka.Config.KeyParallelism) against Watermill's default Kafka
// subscriber in the same run, with the idempotency middleware and a
// handler holding a real Postgres transaction (the middleware's, in which
// the handler runs `SELECT pg_sleep(d)`) for 0, 5 and 50 ms. A second
// scenario makes one key fail for 30 s and measures the other keys'
// throughput against a run without the failure. Every run counts per-key
// reorders and commits past an unfinished message (the group's committed
// offsets, read from the broker during the run, against what the handlers
// finished); both must be 0.
package consumebench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/retry"
)

// Targets of issue 33: the keyed consumer's rate over Watermill's.
const (
	TargetSlowHandler  = 8.0  // at 50 ms
	TargetTrivial      = 0.95 // at 0 ms
	TargetFailingOther = 0.95 // the other keys' rate while one key fails, over the run without failure
)

// KeyFailureMiddleware wraps the handler in the failing-key scenario (both
// its runs, with and without the failure), outermost, before the
// idempotency middleware. Its default is the retry middleware (3 attempts
// in place from 50 ms), after which the keyed consumer redelivers the
// nacked message in its key's place: the key waits, the other keys go on.
// Replace it (before Run) with a middleware that parks the failing key
// instead, to measure that; it is called once per run.
var KeyFailureMiddleware = func() (message.HandlerMiddleware, error) {
	m, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{MaxAttempts: 3, InitialInterval: 50 * time.Millisecond}})
	if err != nil {
		return nil, err
	}
	return m.Middleware, nil
}

// Kinds Run measures.
const (
	KindKafka = "kafka"
	KindAMQP  = "amqp"
	KindNATS  = "nats"
)

// Config configures Run.
type Config struct {
	// Kind is the broker: KindKafka (default) or KindAMQP (RabbitMQ:
	// amqp.Config.KeyParallelism against watermill-amqp's subscriber; the
	// throughput scenario only).
	Kind string
	// Brokers of the Kafka cluster. Required with KindKafka.
	Brokers []string
	// AMQPURL is the RabbitMQ URL. Required with KindAMQP.
	AMQPURL string
	// NATSURL is the nats-server URL (JetStream). Required with KindNATS
	// (nats.Config.KeyParallelism against the same consumer one message
	// at a time; the throughput scenario only).
	NATSURL string
	// DB is a pool on a scratch schema with idempotency.Migrations()
	// applied; its MaxOpenConns bounds the handlers running at once.
	// Required.
	DB *sql.DB
	// Partitions of each topic the bench creates. Default 8.
	Partitions int32
	// Keys the messages are spread over (uniformly at random). Default 10,000.
	Keys int
	// Delays are the handler's transaction durations. Default 0, 5 ms, 50 ms.
	Delays []time.Duration
	// NoThroughput skips the throughput scenario (only the failing key's
	// runs). Default false.
	NoThroughput bool
	// Scale multiplies the default message counts (20,000 at 0 ms, 8,000
	// at 5 ms, 6,000 at 50 ms and 16,000 in the failing-key scenario, whose
	// runs are short: the other keys' rate needs a few seconds to settle).
	// Default 1.
	Scale float64
	// KeyParallelism of the keyed consumer. Default 16.
	KeyParallelism int
	// FailFor is how long the failing key fails. Default 30 s; -1 skips
	// the scenario.
	FailFor time.Duration
	// Progress receives a line per run. Default io.Discard.
	Progress io.Writer
	// Step, if set, is called after each run with the runs done and the
	// runs in all.
	Step func(done, total int)
}

func (c *Config) setDefaults() {
	if c.Kind == "" {
		c.Kind = KindKafka
	}
	if c.Partitions == 0 {
		c.Partitions = 8
	}
	if c.Keys == 0 {
		c.Keys = 10000
	}
	if len(c.Delays) == 0 {
		c.Delays = []time.Duration{0, 5 * time.Millisecond, 50 * time.Millisecond}
	}
	if c.Scale == 0 {
		c.Scale = 1
	}
	if c.KeyParallelism == 0 {
		c.KeyParallelism = 16
	}
	if c.FailFor == 0 {
		c.FailFor = 30 * time.Second
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	switch {
	case c.Kind != KindKafka && c.Kind != KindAMQP && c.Kind != KindNATS:
		errs = append(errs, fmt.Errorf("bench consume: --kind %q: want kafka, amqp or nats", c.Kind))
	case c.Kind == KindNATS && (c.NATSURL == "" || c.DB == nil):
		errs = append(errs, errors.New("bench consume: Config.NATSURL and Config.DB are required (--nats-url or MILLWRIGHT_NATS_URL; --database-url)"))
	case c.Kind == KindAMQP && (c.AMQPURL == "" || c.DB == nil):
		errs = append(errs, errors.New("bench consume: Config.AMQPURL and Config.DB are required (--amqp-url or MILLWRIGHT_AMQP_URL; --database-url)"))
	case c.Kind == KindKafka && (len(c.Brokers) == 0 || c.DB == nil):
		errs = append(errs, errors.New("bench consume: Config.Brokers and Config.DB are required (--brokers or MILLWRIGHT_KAFKA_BROKERS; --database-url)"))
	}
	if c.Partitions < 1 || c.Keys < 1 || c.KeyParallelism < 1 || c.Scale <= 0 {
		errs = append(errs, fmt.Errorf("bench consume: --partitions %d, --keys %d, --key-parallelism %d and --scale %g must be positive", c.Partitions, c.Keys, c.KeyParallelism, c.Scale))
	}
	for _, d := range c.Delays {
		if d < 0 {
			errs = append(errs, fmt.Errorf("bench consume: delay %s is negative", d))
		}
	}
	if c.FailFor < -1 {
		errs = append(errs, fmt.Errorf("bench consume: --fail-for %s: want a positive duration, or -1 to skip the scenario", c.FailFor))
	}
	return errors.Join(errs...)
}

// messages returns the message count for a delay.
func (c Config) messages(d time.Duration) int {
	n := 20000
	switch {
	case d >= 50*time.Millisecond:
		n = 6000
	case d >= 5*time.Millisecond:
		n = 8000
	case d > 0:
		n = 12000
	}
	return max(100, int(float64(n)*c.Scale))
}

// Consumers.
const (
	ConsumerWatermill = "watermill-kafka"
	ConsumerKeyed     = "millwright keyed"
)

// Row is one run's figures, and one --json object.
type Row struct {
	Bench    string  `json:"bench"`    // "consume"
	Kind     string  `json:"kind"`     // "kafka", "amqp" or "nats"
	Scenario string  `json:"scenario"` // "throughput" or "one key failing"
	Consumer string  `json:"consumer"`
	DelayMS  float64 `json:"delay_ms"`
	Messages int     `json:"messages"`
	// Failing says whether one key failed during the run.
	Failing bool `json:"failing,omitempty"`
	// Rate is messages/s between the 10th and the 90th percentile of the
	// finish times (in the failing-key scenario: of the other keys'
	// messages), the steady state of the run.
	Rate float64 `json:"msgs_per_s"`
	// Ratio is Rate over the baseline's in the same run (Watermill's
	// subscriber; for the failing run, the mean of the runs without
	// failure before and after it); Target
	// the goal for it (0: none).
	Ratio  float64 `json:"ratio,omitempty"`
	Target float64 `json:"target,omitempty"`
	// Reorders counts messages of a key finished while its predecessor
	// was not; CommitsPastUnfinished counts messages found unfinished
	// below an offset the broker had committed for the group. Both must
	// be 0. CommitSamples is how many times the offsets were read.
	Reorders              int     `json:"reorders"`
	CommitsPastUnfinished int     `json:"commits_past_unfinished"`
	CommitSamples         int     `json:"commit_samples"`
	Seconds               float64 `json:"seconds"`
}

// Report is Run's result.
type Report struct {
	Rows []Row
	// Partitions, Keys, KeyParallelism and MaxConns describe the run.
	Partitions     int32
	Keys           int
	KeyParallelism int
	MaxConns       int
	// Kind is the broker measured; Notes say what was not run and why.
	Kind  string
	Notes []string
}

// Run runs every scenario and returns the figures.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rep := &Report{Partitions: cfg.Partitions, Keys: cfg.Keys, KeyParallelism: cfg.KeyParallelism, MaxConns: cfg.DB.Stats().MaxOpenConnections, Kind: cfg.Kind}
	if cfg.NoThroughput {
		cfg.Delays = nil
	}
	if cfg.Kind == KindAMQP {
		return runAMQP(ctx, cfg, rep)
	}
	if cfg.Kind == KindNATS {
		return runNATS(ctx, cfg, rep)
	}
	total := 2 * len(cfg.Delays)
	if cfg.FailFor > 0 {
		total += 3
	}
	b := &bench{cfg: cfg, rnd: rand.New(rand.NewSource(time.Now().UnixNano())), total: total}
	defer b.cleanup()
	for _, d := range cfg.Delays {
		rows, err := b.throughput(ctx, d)
		if err != nil {
			return rep, err
		}
		rep.Rows = append(rep.Rows, rows...)
	}
	if cfg.FailFor > 0 {
		rows, err := b.failingKey(ctx)
		if err != nil {
			return rep, err
		}
		rep.Rows = append(rep.Rows, rows...)
	}
	return rep, nil
}

// WriteJSON writes one JSON object per row.
func (r Report) WriteJSON(w io.Writer) error { return stats.WriteJSON(w, r.Rows) }

// WriteTable writes the rows and the verdicts.
func (r Report) WriteTable(w io.Writer) error {
	where := fmt.Sprintf("Kafka, %d partitions", r.Partitions)
	if r.Kind == KindAMQP {
		where = "RabbitMQ, one queue per consumer"
	}
	if r.Kind == KindNATS {
		where = "NATS JetStream, one stream, a durable consumer per consumer"
	}
	fmt.Fprintf(w, "%s, %d keys; idempotency middleware; handler: SELECT pg_sleep(delay) in its transaction; keyed consumer KeyParallelism %d; %d database connections\n",
		where, r.Keys, r.KeyParallelism, r.MaxConns)
	fmt.Fprintf(w, "%-16s %-33s %6s %8s %10s %8s %7s %9s %13s %8s\n", "SCENARIO", "CONSUMER", "DELAY", "MESSAGES", "MSG/S", "RATIO", "TARGET", "REORDERS", "PAST UNFIN.", "SECONDS")
	for _, row := range r.Rows {
		consumer := row.Consumer
		if row.Failing {
			consumer += " (1 key failing)"
		}
		ratio, target := "", ""
		if row.Ratio > 0 {
			ratio = fmt.Sprintf("%.2fx", row.Ratio)
		}
		if row.Target > 0 {
			target = fmt.Sprintf(">=%.2fx", row.Target)
		}
		fmt.Fprintf(w, "%-16s %-33s %4.0fms %8d %10.0f %8s %7s %9d %8d/%-4d %8.1f\n", row.Scenario, consumer, row.DelayMS, row.Messages,
			row.Rate, ratio, target, row.Reorders, row.CommitsPastUnfinished, row.CommitSamples, row.Seconds)
	}
	for _, row := range r.Rows {
		if row.Target > 0 {
			verdict := "met"
			if row.Ratio < row.Target {
				verdict = "NOT met"
			}
			fmt.Fprintf(w, "%s at %.0f ms: %.2fx, target >= %.2fx: %s\n", row.Scenario, row.DelayMS, row.Ratio, row.Target, verdict)
		}
		if row.Reorders > 0 || row.CommitsPastUnfinished > 0 {
			fmt.Fprintf(w, "%s %s at %.0f ms: %d reorders, %d commits past unfinished messages: MUST BE 0\n", row.Scenario, row.Consumer, row.DelayMS, row.Reorders, row.CommitsPastUnfinished)
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintln(w, n)
	}
	return nil
}
