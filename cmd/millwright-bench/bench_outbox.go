package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/outboxbench"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

func benchOutboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Outbox write overhead, relay drain rate, claim cost at 1M published rows, commit-to-consumer latency",
		Long: `Measures, in a scratch schema dropped at the end:

  write overhead   a business transaction inserting one row, alone, with one
                   plain extra insert, and with one outbox event (300-byte
                   JSON), interleaved transaction by transaction; the ratio
                   is of median latencies;
  drain            time for N relays (--relays) to publish a --backlog of
                   events spread over --aggregates aggregates, beside N bare
                   loops (the relay's batch of 500, FOR UPDATE SKIP LOCKED in
                   a transaction across the publish, one call per topic, one
                   UPDATE ... ANY) on the same publisher, Watermill's
                   forwarder and the publisher alone, per --kinds;
  claim            one relay round (claim, no-op publish, mark) with nothing
                   due and with 100 rows due, on an empty table and on one
                   holding --published-rows published rows;
  latency          commit-to-consumer p50/p99 at --rate events/s through the
                   relay (LISTEN wake-up, 1 s poll fallback) and through
                   Watermill's forwarder at its default 1 s poll and at a
                   10 ms poll, per --kinds (the sql consumer is woken by
                   NOTIFY, its 1 s poll the fallback); the relay's p99 tail
                   split by stage (from its publish spans), how late a 1 ms
                   sleep wakes meanwhile (the machine's load) and, on sql,
                   which sessions held the xmin horizon;
  retention        (only with --sections retention) removing
                   --published-rows published rows spread over 10 days by
                   the cleaner's batched DELETE (plain layout) and by
                   dropping daily partitions (partitioned layout,
                   docs/partitioning.md), with 4 writers writing meanwhile:
                   time, writers' tx/s against the second before, slowest
                   writer transaction, size and dead tuples left, and a
                   relay round on each layout empty and with the rows.

Every figure is the median of --rounds runs. A drain's relay row compares
each round's run with the bare loops' and the fewer relays' runs of the
same round (seconds apart, so the machine's drift over minutes cancels)
and reports the median of those ratios; odd rounds run the variants in
reverse order (so neither of a bare loop and relay pair, nor of N and
N-1 relays, always goes first), one untimed run of the last variant
goes before the first round, and every run starts after a CHECKPOINT,
with autovacuum off for the outbox table.

Kinds: gochannel, kafka (a real cluster with --kafka-brokers, else an
embedded kfake), googlecloud (a Pub/Sub emulator with --pubsub-emulator,
else an embedded pstest), amqp (--amqp-url), sql (the same Postgres).
Each drain and latency row names the broker it ran on.`,
		RunE: runBenchOutbox,
	}
	cli.AddDatabaseFlag(cmd)
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	cmd.Flags().Int("rounds", 3, "runs per figure; the median is reported")
	cmd.Flags().Int("writes", 2000, "transactions per write-overhead run")
	cmd.Flags().Int("backlog", 100000, "events per drain run (at tens of thousands of events/s a smaller backlog drains in under a second, and the figures measure start-up and noise)")
	cmd.Flags().Int("aggregates", 1000, "aggregates the drain's backlog is spread over")
	cmd.Flags().Int("hot", 0, "percent of the drain's backlog on one more aggregate (0..100; one lane, so one relay publishes those)")
	cmd.Flags().IntSlice("relays", []int{1, 2}, "relay counts of the drain; the bare loop runs at the same counts")
	cmd.Flags().Int("published-rows", 1000000, "published rows for the claim and retention sections (0 skips them)")
	cmd.Flags().StringSlice("kinds", []string{"gochannel", "kafka"}, "transports for drain and latency: gochannel, kafka, googlecloud, amqp, sql, nats")
	addBenchBrokerFlags(cmd)
	cmd.Flags().Int("rate", 200, "events/s for the latency run")
	cmd.Flags().Duration("latency-duration", 5*time.Second, "length of each latency run")
	cmd.Flags().Bool("no-forwarders", false, "latency: run the relay alone, without Watermill's forwarder beside it")
	cmd.Flags().StringSlice("sections", []string{"write", "drain", "claim", "latency"}, "which parts to run: write, drain, claim, latency, retention")
	return cmd
}

// benchOutboxConfig is `bench outbox`'s Config from its flags, checked.
func benchOutboxConfig(cmd *cobra.Command) (outboxbench.Config, error) {
	f := cmd.Flags()
	rounds, _ := f.GetInt("rounds")
	writes, _ := f.GetInt("writes")
	backlog, _ := f.GetInt("backlog")
	aggregates, _ := f.GetInt("aggregates")
	hot, _ := f.GetInt("hot")
	relays, _ := f.GetIntSlice("relays")
	published, _ := f.GetInt("published-rows")
	rate, _ := f.GetInt("rate")
	latDur, _ := f.GetDuration("latency-duration")
	noFwd, _ := f.GetBool("no-forwarders")
	sections, _ := f.GetStringSlice("sections")
	asJSON, _ := f.GetBool("json")
	if rounds < 1 || writes < 1 || backlog < 1 || rate < 1 || published < 0 || aggregates < 1 {
		return outboxbench.Config{}, errors.New("bench outbox: --rounds, --writes, --backlog, --aggregates and --rate must be at least 1, --published-rows at least 0")
	}
	if hot < 0 || hot > 100 {
		return outboxbench.Config{}, fmt.Errorf("bench outbox: --hot %d: want a percent, 0..100", hot)
	}
	for _, n := range relays {
		if n < 1 || n > 64 {
			return outboxbench.Config{}, fmt.Errorf("bench outbox: --relays %d: want 1..64", n)
		}
	}
	drivers, err := benchDrivers(cmd)
	if err != nil {
		return outboxbench.Config{}, fmt.Errorf("bench outbox: %w", err)
	}
	return outboxbench.Config{Drivers: drivers, Rounds: rounds, Writes: writes, Backlog: backlog, Aggregates: aggregates, HotPercent: hot, Relays: relays,
		PublishedRows: published, Rate: rate, LatencyDuration: latDur, NoForwarders: noFwd, Sections: sections, Group: sinkGroup,
		Out: cmd.OutOrStdout(), JSON: asJSON}, nil
}

func runBenchOutbox(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	f := cmd.Flags()
	cfg, err := benchOutboxConfig(cmd)
	if err != nil {
		return err
	}
	asJSON := cfg.JSON
	kindFlag, _ := f.GetStringSlice("kinds")
	cfg.Progress = func(format string, args ...any) {
		if !asJSON {
			fmt.Fprintf(cmd.ErrOrStderr(), format+"\n", args...)
		}
	}
	if slices.Contains(cfg.Sections, outboxbench.SectionDrain) || slices.Contains(cfg.Sections, outboxbench.SectionLatency) {
		kinds, err := benchKinds("outbox", kindFlag, transport.GoChannel, transport.Kafka, transport.GoogleCloud, transport.AMQP, transport.SQL, transport.NATS)
		if err != nil {
			return err
		}
		brokers, err := benchBrokersFromFlags(cmd)
		if err != nil {
			return err
		}
		for _, l := range brokers.notice(kinds) {
			fmt.Fprintln(cmd.ErrOrStderr(), l)
		}
		cfg.Kinds = kinds
		cfg.Open = func(kind transport.Kind) (outboxbench.Broker, error) {
			return openOutboxBenchBroker(brokers, kind, cfg.DB, cfg.URL)
		}
	}

	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	flagURL, _ := f.GetString("database-url")
	_, schemaURL, drop, err := benchdb.Scratch(ctx, admin, cli.DatabaseURL(flagURL), "mw_bench")
	if err != nil {
		return err
	}
	defer drop()
	// Named, so that the latency section tells its own sessions holding
	// the xmin horizon from the server's other sessions.
	schemaURL = cli.WithDSNParam(schemaURL, "application_name", outboxbench.AppName)
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(24)
	db.SetMaxIdleConns(24)
	if _, err := migrate.Up(ctx, postgres.From(db), outbox.Migrations()); err != nil {
		return err
	}
	cfg.DB, cfg.URL = db, schemaURL
	step, end := benchProgress(cmd)
	cfg.Step = step
	cfg.Out = cmd.OutOrStdout() // wrapped by benchProgress on a terminal
	return end(outboxbench.Run(ctx, cfg))
}

// openOutboxBenchBroker is the transport of one drain or latency section,
// on the broker the flags chose (a fresh fake per section when none is
// real).
func openOutboxBenchBroker(brokers benchBrokers, kind transport.Kind, db *sql.DB, dbURL string) (outboxbench.Broker, error) {
	if kind == transport.SQL {
		cfg := transport.Config{Kind: transport.SQL}
		cfg.SQL.DB = db
		// The consumer is woken by NOTIFY on its own connection to the
		// same database; its poll (1 s) is only the fallback, so the
		// latency rows show the relay's part and the database's, not a
		// poll. The forwarder is measured with the same consumer.
		cfg.SQL.ListenURL = dbURL
		cfg.SQL.PollInterval = outboxbench.SQLConsumerPoll
		return outboxbench.Broker{Config: cfg, Label: postgresLabel(dbURL)}, nil
	}
	br, err := brokers.open(kind)
	if err != nil {
		return outboxbench.Broker{}, err
	}
	cfg := br.Config
	cfg.AMQP.DeclareGroups = []string{sinkGroup}
	cfg.GoogleCloud.DeclareGroups = []string{sinkGroup}
	if kind == transport.GoChannel {
		// Nothing subscribes to the drain topic: keep gochannel from
		// holding every message for a subscriber that never comes.
		cfg.GoChannel.NotPersistent = true
	}
	return outboxbench.Broker{Config: cfg, Label: br.Label, Done: func(ctx context.Context, topics []string) {
		br.dropTopics(ctx, topics...)
		br.Close()
	}}, nil
}
