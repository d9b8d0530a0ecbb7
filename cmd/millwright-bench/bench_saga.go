package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/sagabench"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
)

func benchSagaCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "saga",
		Short: "Completed 3-step sagas per second, p50/p99 saga duration and where a step's time goes, beside the database's ceiling",
		Long: `Starts --sagas sagas of three steps (reserve, charge, ship), each in its own
transaction, from --starters goroutines, and waits until every one has
completed. Participants are in-process handlers that answer at once; commands
go through the outbox relay, replies through the transport, and the
orchestrator consumes them behind the idempotency middleware. Runs in a
scratch schema per run (dropped at the end), on topics named after it; ten
warm-up sagas complete before the clock starts. gochannel is the baseline
without a broker; kafka is a real cluster with --kafka-brokers, else
franz-go's in-process kfake; googlecloud is a Pub/Sub emulator with
--pubsub-emulator, else the in-process pstest (which delivers at most about
800 msg/s); amqp is the RabbitMQ of --amqp-url (its queues are deleted at
the end); sql is the database itself. Each row names its broker.

Two runs per kind: "throughput" starts all sagas as fast as the starters can
(durations then include queueing), "latency" starts --latency-sagas at
--latency-rate sagas/s, below capacity, so durations show one saga's path.
Both are repeated --rounds times, the kinds taking turns, and each row is
its median round (by rate, by p99 for latency), with that round's hops.
Figures: sagas/s = sagas / (first start .. last completion); duration = start
to completion per saga; P99/P50 their ratio. The hop table splits a step's
time: command written -> participant (commit, relay wake-up, claim, publish,
delivery), participant -> orchestrator (reply publish, delivery), and the
orchestrator's transaction. --shapes runs the same three steps as a line, with
reserve and charge at once (a two-branch group), and as a line with a second
version of the saga registered beside it; VS LINEAR compares each with the
linear run of the same kind and driver. The ceiling is the database's single-row commit
rate with --starters writers, measured in the same run, over the
transactions one saga costs (TX/SAGA); OF CEILING is the throughput's
fraction of it.`,
		Args: cobra.NoArgs,
		RunE: runBenchSaga,
	}
	cli.AddDatabaseFlag(cmd)
	cmd.Flags().Int("sagas", 2000, "sagas per run")
	cmd.Flags().Int("starters", 16, "goroutines starting sagas (also the writers of the ceiling)")
	cmd.Flags().StringSlice("kinds", []string{"gochannel", "kafka"}, "transports: gochannel, kafka, googlecloud, amqp, sql")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the tables")
	addBenchBrokerFlags(cmd)
	cmd.Flags().Duration("timeout", 5*time.Minute, "give up a run after this long")
	cmd.Flags().Int("latency-sagas", 200, "sagas in the latency run (0 skips it)")
	cmd.Flags().Float64("latency-rate", 20, "sagas started per second in the latency run")
	cmd.Flags().Int("consumers", 16, "subscribers per topic in one consumer group on amqp (whose subscribers handle one message at a time); 1 elsewhere")
	cmd.Flags().Int("relays", 1, "outbox relays")
	cmd.Flags().Int("kafka-key-parallelism", 0, "on kafka, messages of different sagas handled at once per partition by every consumer (transport/kafka Config.KeyParallelism; 0: one at a time, Watermill's subscriber)")
	cmd.Flags().Int("sql-reply-shards", 4, "reply topics on sql (saga.Config.ReplyShards: watermill-sql applies a topic's messages one at a time); other kinds use one")
	cmd.Flags().Int("rounds", 3, "rounds of every run, the kinds taking turns; each row is its median round (all rounds' figures are printed below the tables)")
	cmd.Flags().Int("relay-publish-concurrency", 0, "the relays' PublishConcurrency: concurrent Publish calls of a batch on publishers without PublishBatch (amqp, googlecloud, gochannel); 0: the relay's default")
	cmd.Flags().Duration("ceiling", 3*time.Second, "how long the database's commit rate is measured (0 skips the ceiling)")
	cmd.Flags().Bool("keep-schema", false, "keep each run's scratch schema (printed) for inspection")
	cmd.Flags().StringSlice("shapes", []string{sagabench.ShapeLinear, sagabench.ShapeParallel, sagabench.ShapeVersions},
		"saga shapes: linear (reserve, charge, ship), parallel (reserve and charge at once, then ship), versions (linear with a second version registered)")
	return cmd
}

// benchSagaConfig is `bench saga`'s Config from its figure flags, checked.
func benchSagaConfig(cmd *cobra.Command) (sagabench.Config, error) {
	var cfg sagabench.Config
	f := cmd.Flags()
	cfg.Sagas, _ = f.GetInt("sagas")
	cfg.Starters, _ = f.GetInt("starters")
	cfg.Timeout, _ = f.GetDuration("timeout")
	cfg.KeepSchema, _ = f.GetBool("keep-schema")
	cfg.LatencySagas, _ = f.GetInt("latency-sagas")
	cfg.LatencyRate, _ = f.GetFloat64("latency-rate")
	cfg.Consumers, _ = f.GetInt("consumers")
	cfg.Relays, _ = f.GetInt("relays")
	cfg.SQLReplyShards, _ = f.GetInt("sql-reply-shards")
	cfg.KafkaKeyParallelism, _ = f.GetInt("kafka-key-parallelism")
	cfg.Rounds, _ = f.GetInt("rounds")
	cfg.RelayPublishConcurrency, _ = f.GetInt("relay-publish-concurrency")
	cfg.CeilingFor, _ = f.GetDuration("ceiling")
	cfg.Shapes, _ = f.GetStringSlice("shapes")
	if cfg.Sagas < 1 || cfg.Starters < 1 || cfg.LatencySagas < 0 || cfg.LatencyRate <= 0 || cfg.Consumers < 1 || cfg.Relays < 1 || cfg.SQLReplyShards < 1 || cfg.Rounds < 1 || cfg.CeilingFor < 0 || cfg.RelayPublishConcurrency < 0 || cfg.KafkaKeyParallelism < 0 {
		return cfg, errors.New("bench saga: --sagas, --starters, --consumers, --relays, --sql-reply-shards and --rounds must be at least 1, --latency-sagas, --ceiling, --kafka-key-parallelism and --relay-publish-concurrency at least 0, --latency-rate above 0")
	}
	return cfg, nil
}

func runBenchSaga(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	f := cmd.Flags()
	cfg, err := benchSagaConfig(cmd)
	if err != nil {
		return err
	}
	kindFlag, _ := f.GetStringSlice("kinds")
	asJSON, _ := f.GetBool("json")
	if cfg.Kinds, err = benchKinds("saga", kindFlag, transport.GoChannel, transport.Kafka, transport.GoogleCloud, transport.AMQP, transport.SQL); err != nil {
		return err
	}
	brokers, err := benchBrokersFromFlags(cmd)
	if err != nil {
		return err
	}
	for _, l := range brokers.notice(cfg.Kinds) {
		fmt.Fprintln(cmd.ErrOrStderr(), l)
	}
	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	flagURL, _ := f.GetString("database-url")
	base := cli.DatabaseURL(flagURL)
	cfg.Admin = admin
	cfg.PostgresLabel = postgresLabel(base)
	if cfg.Drivers, err = benchDrivers(cmd); err != nil {
		return fmt.Errorf("bench saga: %w", err)
	}
	cfg.Progress = cmd.ErrOrStderr()
	cfg.Scratch = func(ctx context.Context, prefix string) (string, string, func(), error) {
		return benchdb.Scratch(ctx, admin, base, prefix)
	}
	cfg.OpenBroker = func(kind transport.Kind) (sagabench.Broker, error) {
		br, err := brokers.open(kind)
		if err != nil {
			return sagabench.Broker{}, err
		}
		return sagabench.Broker{Config: br.Config, Label: br.Label, Close: br.Close,
			Cleanup: func(ctx context.Context, topics, groups []string) {
				if kind == transport.AMQP && br.stop == nil {
					_ = amqp.DeleteTopology(br.Config.AMQP.URL, topics, groups...)
					return
				}
				br.dropTopics(ctx, topics...)
			}}, nil
	}
	step, end := benchProgress(cmd)
	cfg.Step = step
	cfg.Progress = cmd.ErrOrStderr() // wrapped by benchProgress on a terminal
	rep, err := sagabench.Run(ctx, cfg)
	err = end(err)
	if len(rep.Rows) > 0 {
		// Also when a later run failed: what was measured is printed.
		write := rep.WriteTable
		if asJSON {
			write = rep.WriteJSON
		}
		if werr := write(cmd.OutOrStdout()); werr != nil && err == nil {
			err = werr
		}
	}
	return err
}
