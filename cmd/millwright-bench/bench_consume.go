package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/consumebench"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/envparse"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
)

func init() { rootCmd.AddCommand(benchConsumeCmd()) }

func benchConsumeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "consume",
		Short: "Consumer msgs/s on Kafka: millwright's key-parallel consumer against Watermill's subscriber, and one key failing",
		Long: `Publishes messages over --keys keys (uniformly at random) to a topic of
--partitions partitions on a real Kafka, then consumes them twice in the same
run: with Watermill's default Kafka subscriber (one message per partition at a
time) and with millwright's key-parallel consumer (kafka.Config.KeyParallelism,
MILLWRIGHT_KAFKA_KEY_PARALLELISM). Both run through a Watermill Router with the
idempotency middleware; the handler runs SELECT pg_sleep(delay) in the
middleware's transaction (a real Postgres transaction held for the delay), for
each of --delays. RATIO is the keyed consumer's msgs/s over Watermill's.

The "one key failing" scenario runs the keyed consumer with the retry middleware
(consumebench.KeyFailureMiddleware) three times over one topic, with a 5 ms
handler: without failure, with the key having the most messages failing for
--fail-for, and without failure again; RATIO is the other keys' msgs/s over the
mean of the runs without failure. With --park the failing key is parked in
Postgres (package park) after its in-place attempts and retried by park's
retrier, in all three runs (so that each pays park's check per message).

Every run counts per-key reorders and commits past unfinished messages (the
group's committed offsets read from the broker every 250 ms against what the
handlers finished): both must be 0. Works in a scratch schema dropped at the
end; topics and groups are deleted at the end.

With --kind amqp the throughput scenario runs on RabbitMQ: one fanout
exchange per delay with a queue for each consumer, watermill-amqp's subscriber
(one delivery at a time; its run stops after about 15 s of messages, its rate
read over its steady state) against the keyed consumer
(amqp.Config.KeyParallelism, MILLWRIGHT_AMQP_KEY_PARALLELISM, --key-parallelism
keys at once over the queue). Reorders are counted; RabbitMQ has no committed
position to read, so no commit samples.

With --kind nats the same scenario runs on NATS JetStream: one stream per
delay with a durable consumer for each consumer, the subscriber one message
at a time (KeyParallelism 0; its run stops after about 15 s of messages)
against the keyed consumer (nats.Config.KeyParallelism,
MILLWRIGHT_NATS_KEY_PARALLELISM, --key-parallelism keys at once).`,
		Args: cobra.NoArgs,
		RunE: runBenchConsume,
	}
	f := cmd.Flags()
	f.String("kind", consumebench.KindKafka, "broker: kafka, amqp (RabbitMQ: the keyed consumer against watermill-amqp's subscriber, throughput only) or nats (JetStream: the keyed consumer against one at a time, throughput only)")
	f.String("nats-url", "", "URL of a real nats-server with JetStream, with --kind nats (default $"+transport.EnvNATSURL+")")
	f.String("kafka-brokers", "", "comma-separated host:port of a real Kafka (default $"+transport.EnvKafkaBrokers+")")
	f.String("amqp-url", "", "URL of a real RabbitMQ, with --kind amqp (default $"+transport.EnvAMQPURL+")")
	f.Int32("partitions", 8, "partitions of each topic")
	f.Int("keys", 10000, "keys the messages are spread over")
	f.String("delays", "0,5ms,50ms", "comma-separated handler transaction durations; none: only the failing-key scenario")
	f.Float64("scale", 1, "multiplies the message counts (20,000 at 0 ms, 8,000 at 5 ms, 6,000 at 50 ms, 16,000 with one key failing)")
	f.Int("key-parallelism", 16, "KeyParallelism of the keyed consumer (keys at once per partition)")
	f.Int("max-conns", 80, "database connections (each running handler holds one)")
	f.Duration("fail-for", 30*time.Second, "how long the failing key fails; -1ns skips the scenario")
	f.Bool("park", false, "in the failing-key scenario, park the failing key (package park, outermost, before 3 in-place attempts) instead of redelivering it in its key's place")
	f.Bool("json", false, "print one JSON object per row instead of the table")
	cli.AddDatabaseFlag(cmd)
	return cmd
}

func runBenchConsume(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	var cfg consumebench.Config
	f := cmd.Flags()
	if err := benchConsumeBroker(cmd, &cfg); err != nil {
		return err
	}
	cfg.Partitions, _ = f.GetInt32("partitions")
	cfg.Keys, _ = f.GetInt("keys")
	cfg.Scale, _ = f.GetFloat64("scale")
	cfg.KeyParallelism, _ = f.GetInt("key-parallelism")
	cfg.FailFor, _ = f.GetDuration("fail-for")
	if cfg.FailFor < 0 {
		cfg.FailFor = -1
	}
	delays, _ := f.GetString("delays")
	cfg.NoThroughput = delays == "none"
	for _, s := range envparse.List(delays) {
		if cfg.NoThroughput {
			break
		}
		if s == "0" {
			s = "0s"
		}
		d, err := time.ParseDuration(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("bench consume: --delays %q: %q is not a duration such as 5ms", delays, s)
		}
		cfg.Delays = append(cfg.Delays, d)
	}
	conns, _ := f.GetInt("max-conns")
	if conns < 1 {
		return errors.New("bench consume: --max-conns must be at least 1")
	}
	asJSON, _ := f.GetBool("json")
	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	u, _ := f.GetString("database-url")
	_, schemaURL, drop, err := benchdb.Scratch(ctx, admin, cli.DatabaseURL(u), "mw_bench_consume")
	if err != nil {
		return err
	}
	defer drop()
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	if _, err := migrate.Up(ctx, postgres.From(db), idempotency.Migrations()); err != nil {
		return err
	}
	if usePark, _ := f.GetBool("park"); usePark {
		stop, err := parkFailingKey(ctx, db)
		if err != nil {
			return err
		}
		defer stop()
	}
	cfg.DB = db
	step, end := benchProgress(cmd)
	cfg.Progress = cmd.ErrOrStderr()
	cfg.Step = step
	rep, err := consumebench.Run(ctx, cfg)
	if err := end(err); err != nil {
		return err
	}
	if asJSON {
		return rep.WriteJSON(cmd.OutOrStdout())
	}
	return rep.WriteTable(cmd.OutOrStdout())
}

// parkFailingKey makes the failing-key scenario's wrapper package park's
// middleware around 3 in-place attempts, each run with a Parker of its
// own (and a handler name of its own) whose retrier runs until stop. The
// retry budget outlasts --fail-for many times, so the failing key heals
// instead of going to the DLQ.
func parkFailingKey(ctx context.Context, db *sql.DB) (stop func(), err error) {
	if _, err := migrate.Up(ctx, postgres.From(db), dlq.Migrations(), park.Migrations()); err != nil {
		return nil, err
	}
	var parkers []*park.Parker
	n := 0
	consumebench.KeyFailureMiddleware = func() (message.HandlerMiddleware, error) {
		n++
		p, err := park.New(postgres.From(db), park.Config{
			Retry:        retry.Policy{InitialInterval: 100 * time.Millisecond, MaxInterval: time.Second, MaxAttempts: -1, MaxElapsedTime: 30 * time.Minute},
			PollInterval: 50 * time.Millisecond,
		})
		if err != nil {
			return nil, err
		}
		inPlace, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{MaxAttempts: 3, InitialInterval: 50 * time.Millisecond}})
		if err != nil {
			return nil, err
		}
		parkers = append(parkers, p)
		go func() { _ = p.Run(ctx) }()
		outer := p.Middleware(fmt.Sprintf("bench-%d", n))
		return func(h message.HandlerFunc) message.HandlerFunc { return outer(inPlace.Middleware(h)) }, nil
	}
	return func() {
		for _, p := range parkers {
			_ = p.Close()
		}
	}, nil
}

// benchConsumeBroker reads --kind and the broker's address into cfg.
func benchConsumeBroker(cmd *cobra.Command, cfg *consumebench.Config) error {
	f := cmd.Flags()
	cfg.Kind, _ = f.GetString("kind")
	switch cfg.Kind {
	case consumebench.KindAMQP:
		cfg.AMQPURL, _ = f.GetString("amqp-url")
		if cfg.AMQPURL == "" {
			cfg.AMQPURL = os.Getenv(transport.EnvAMQPURL)
		}
		if cfg.AMQPURL == "" {
			return errors.New("bench consume: --kind amqp needs a real RabbitMQ: set --amqp-url or " + transport.EnvAMQPURL)
		}
	case consumebench.KindNATS:
		cfg.NATSURL, _ = f.GetString("nats-url")
		if cfg.NATSURL == "" {
			cfg.NATSURL = os.Getenv(transport.EnvNATSURL)
		}
		if cfg.NATSURL == "" {
			return errors.New("bench consume: --kind nats needs a real nats-server with JetStream: set --nats-url or " + transport.EnvNATSURL)
		}
	case consumebench.KindKafka:
		brokers, _ := f.GetString("kafka-brokers")
		if brokers == "" {
			brokers = os.Getenv(transport.EnvKafkaBrokers)
		}
		cfg.Brokers = envparse.List(brokers)
		if len(cfg.Brokers) == 0 {
			return errors.New("bench consume: needs a real Kafka: set --kafka-brokers or " + transport.EnvKafkaBrokers)
		}
	default:
		return fmt.Errorf("bench consume: --kind %q: want kafka, amqp or nats", cfg.Kind)
	}
	return nil
}
