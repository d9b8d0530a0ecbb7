package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright/internal/bench/sagabench"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
)

func init() {
	registerMigrations(saga.Migrations())
	rootCmd.AddCommand(sagaCmd())
	benchCmd.AddCommand(benchSagaCmd())
}

func sagaCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "saga",
		Short: "Inspect saga instances and resolve stuck ones",
		Long: `Saga instances live in millwright_saga_instances, their step history in
millwright_saga_steps. These commands read them and hand stuck sagas back to
the orchestrators. A saga type's state diagram comes from its Go definition:
print Definition.Mermaid().`,
	}
	cmd.AddCommand(sagaListCmd(), sagaShowCmd(), sagaResolveCmd(), cleanCmd("saga"))
	return cmd
}

func sagaListCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List saga instances, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var f saga.Filter
			f.Type, _ = cmd.Flags().GetString("type")
			state, _ := cmd.Flags().GetString("state")
			f.State = saga.State(state)
			f.Limit, _ = cmd.Flags().GetInt("limit")
			switch f.State {
			case "", saga.StateRunning, saga.StateCompensating, saga.StateCompleted, saga.StateCompensated, saga.StateStuck:
			default:
				return fmt.Errorf("--state %q: want running, compensating, completed, compensated or stuck", state)
			}
			if f.Limit < 0 {
				return fmt.Errorf("--limit %d: want >= 0 (0 means no limit)", f.Limit)
			}
			if f.Limit == 0 {
				f.Limit = -1
			}
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, err := saga.List(cmd.Context(), pool.handle(), f)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if len(rows) == 0 {
				fmt.Fprintln(out, "no sagas match")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tTYPE\tSTATE\tSTEP\tVERSION\tCREATED\tUPDATED\tLAST ERROR")
			for _, in := range rows {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", in.ID, in.Type, in.State, dash(in.Step), in.Version,
					in.CreatedAt.UTC().Format(time.RFC3339), in.UpdatedAt.UTC().Format(time.RFC3339), dash(oneLine(in.LastError, 80)))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if f.Limit > 0 && len(rows) == f.Limit {
				fmt.Fprintf(out, "(first %d rows; narrow with --type/--state or pass --limit 0 for all)\n", f.Limit)
			}
			return nil
		},
	}
	cmd.Flags().String("type", "", "only sagas of this type (definition name)")
	cmd.Flags().String("state", "", "only sagas in this state: running, compensating, completed, compensated, stuck")
	cmd.Flags().Int("limit", 50, "at most this many rows, newest first (0: no limit)")
	addDatabaseFlag(cmd)
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func sagaShowCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID",
		Short: "Show a saga instance, its data and its step history with times and errors",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			in, hist, err := saga.Get(cmd.Context(), pool.handle(), args[0])
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintf(w, "id:\t%s\n", in.ID)
			fmt.Fprintf(w, "type:\t%s\n", in.Type)
			fmt.Fprintf(w, "state:\t%s\n", in.State)
			fmt.Fprintf(w, "step:\t%s\n", dash(in.Step))
			fmt.Fprintf(w, "version:\t%d\n", in.Version)
			fmt.Fprintf(w, "created:\t%s\n", in.CreatedAt.UTC().Format(time.RFC3339Nano))
			fmt.Fprintf(w, "updated:\t%s\n", in.UpdatedAt.UTC().Format(time.RFC3339Nano))
			if !in.Deadline.IsZero() {
				what := "reply due"
				if !in.AwaitingReply {
					what = "next compensation attempt"
				}
				fmt.Fprintf(w, "deadline:\t%s (%s)\n", in.Deadline.UTC().Format(time.RFC3339Nano), what)
			}
			if in.CompensationAttempts > 0 {
				fmt.Fprintf(w, "compensation attempts:\t%d\n", in.CompensationAttempts)
			}
			fmt.Fprintf(w, "last error:\t%s\n", dash(in.LastError))
			fmt.Fprintf(w, "data:\t%s\n", in.Data)
			if err := w.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(out, "\nhistory (%d entries):\n", len(hist))
			w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "TIME\t+MS\tSTEP\tKIND\tDETAIL\tATTEMPT\tERROR")
			for _, h := range hist {
				fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%d\t%s\n", h.At.UTC().Format("2006-01-02T15:04:05.000Z"),
					h.At.Sub(in.CreatedAt).Milliseconds(), dash(h.Step), h.Kind, dash(h.Detail), h.Attempt, dash(oneLine(h.Error, 100)))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if in.State == saga.StateStuck {
				fmt.Fprintf(out, "\nstuck: fix the participant, then `millwright saga resolve %s` (retry) or `--action skip` if compensated by hand\n", in.ID)
			}
			return nil
		},
	}
	addDatabaseFlag(cmd)
	return cmd
}

func sagaResolveCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "resolve ID",
		Short: "Hand a stuck saga back to the orchestrators (retry its compensation, or skip it)",
		Long: `A saga is stuck when a compensation spent its retry budget. Once the
participant is fixed:

  --action retry  sends the stuck compensation again with a fresh budget;
  --action skip   records it as done by hand and continues with the
                  compensations of the earlier steps.

The next round of any running orchestrator of the saga's type acts on it.
--dry-run prints what would be done and writes only its audit row. On a
terminal it shows the resolution and asks to confirm; elsewhere --yes is
required. Every run past flag validation is recorded in millwright_audit.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			action, _ := cmd.Flags().GetString("action")
			note, _ := cmd.Flags().GetString("note")
			dry, _ := cmd.Flags().GetBool("dry-run")
			if a := saga.ResolveAction(action); a != saga.ResolveRetry && a != saga.ResolveSkip {
				return fmt.Errorf("saga resolve: --action: unknown action %q: want %s (send the stuck compensation again) or %s (it was done by hand)", action, saga.ResolveRetry, saga.ResolveSkip)
			}
			change, pool, err := openChange(cmd, args)
			if err != nil {
				return err
			}
			defer pool.Close()
			ctx := cmd.Context()
			out := cmd.OutOrStdout()
			resolve := func(dryRun bool) (saga.Resolution, error) {
				return resolveSaga(ctx, pool, args[0], saga.ResolveAction(action), note, dryRun)
			}
			if dry {
				r, err := resolve(true)
				if err != nil {
					return change.finish(0, err)
				}
				fmt.Fprintf(out, "dry run: would %s (saga %s, type %s)\n", r.Description, r.Info.ID, r.Info.Type)
				return change.finish(1, nil)
			}
			err = change.confirm(func() (string, error) {
				r, err := resolve(true)
				if err != nil {
					return "", err
				}
				return fmt.Sprintf("will %s (saga %s, type %s)", r.Description, r.Info.ID, r.Info.Type), nil
			})
			if err != nil {
				return err
			}
			r, err := resolve(false)
			if err != nil {
				return change.finish(0, err)
			}
			fmt.Fprintf(out, "resolved saga %s (type %s): will %s; a running orchestrator of type %s acts on it within its poll interval\n",
				r.Info.ID, r.Info.Type, r.Description, r.Info.Type)
			return change.finish(1, nil)
		},
	}
	cmd.Flags().String("action", string(saga.ResolveRetry), "retry (send the stuck compensation again) or skip (it was done by hand)")
	cmd.Flags().String("note", "", "recorded in the saga's history with the action")
	cmd.Flags().Bool("dry-run", false, "print what would be done; change nothing but the audit row")
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

// resolveSaga is saga.Resolve on the command's pool (--driver).
func resolveSaga(ctx context.Context, pool *cliPool, id string, action saga.ResolveAction, note string, dryRun bool) (saga.Resolution, error) {
	if pool.pgx != nil {
		return saga.Resolve(ctx, postgres.From(pool.pgx), id, action, note, dryRun)
	}
	return saga.Resolve(ctx, postgres.From(pool.sql), id, action, note, dryRun)
}

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
orchestrator's transaction. The ceiling is the database's single-row commit
rate with --starters writers, measured in the same run, over the
transactions one saga costs (TX/SAGA); OF CEILING is the throughput's
fraction of it.`,
		Args: cobra.NoArgs,
		RunE: runBenchSaga,
	}
	addDatabaseFlag(cmd)
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
	cmd.Flags().Int("sql-reply-shards", 4, "reply topics on sql (saga.Config.ReplyShards: watermill-sql applies a topic's messages one at a time); other kinds use one")
	cmd.Flags().Int("rounds", 3, "rounds of every run, the kinds taking turns; each row is its median round (all rounds' figures are printed below the tables)")
	cmd.Flags().Int("relay-publish-concurrency", 0, "the relays' PublishConcurrency: concurrent Publish calls of a batch on publishers without PublishBatch (amqp, googlecloud, gochannel); 0: the relay's default")
	cmd.Flags().Duration("ceiling", 3*time.Second, "how long the database's commit rate is measured (0 skips the ceiling)")
	cmd.Flags().Bool("keep-schema", false, "keep each run's scratch schema (printed) for inspection")
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
	cfg.Rounds, _ = f.GetInt("rounds")
	cfg.RelayPublishConcurrency, _ = f.GetInt("relay-publish-concurrency")
	cfg.CeilingFor, _ = f.GetDuration("ceiling")
	if cfg.Sagas < 1 || cfg.Starters < 1 || cfg.LatencySagas < 0 || cfg.LatencyRate <= 0 || cfg.Consumers < 1 || cfg.Relays < 1 || cfg.SQLReplyShards < 1 || cfg.Rounds < 1 || cfg.CeilingFor < 0 || cfg.RelayPublishConcurrency < 0 {
		return cfg, errors.New("bench saga: --sagas, --starters, --consumers, --relays, --sql-reply-shards and --rounds must be at least 1, --latency-sagas, --ceiling and --relay-publish-concurrency at least 0, --latency-rate above 0")
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
	base := databaseURL(flagURL)
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
