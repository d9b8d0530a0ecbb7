package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright/internal/bench/outboxbench"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

func init() {
	registerMigrations(outbox.Migrations())
	rootCmd.AddCommand(outboxCmd())
	benchCmd.AddCommand(benchOutboxCmd())
}

func outboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Inspect and repair the transactional outbox",
	}

	status := &cobra.Command{
		Use:   "status",
		Short: "Pending and failed events, oldest pending age, per topic",
		RunE:  runOutboxStatus,
	}
	addDatabaseFlag(status)
	status.Flags().Bool("json", false, "print one JSON object per topic, then the total (with the failed and retrying events as \"problems\")")
	status.Flags().Int("problems", 5, "list this many of the most recent failed events and of the longest-retrying ones, with their last error (0: none)")

	retryFailed := &cobra.Command{
		Use:   "retry-failed",
		Short: "Put failed events back to pending with a fresh retry budget",
		Long: `Puts the outbox rows in the failed state (those that exhausted their
publish attempts) back to pending with a fresh retry budget, and wakes the
relays. --topic and --id narrow the selection; --dry-run only lists it. On a
terminal it shows the selection and asks to confirm; elsewhere --yes is
required. Every run past flag validation is recorded in
millwright_audit (a dry run writes nothing else).
Progress (rows reset of those selected) goes to stderr.`,
		Args: cobra.NoArgs,
		RunE: runRetryFailed,
	}
	addDatabaseFlag(retryFailed)
	retryFailed.Flags().String("topic", "", "retry only this topic's failed events")
	retryFailed.Flags().Int64Slice("id", nil, "retry only these row ids (repeat or comma-separate)")
	retryFailed.Flags().Bool("dry-run", false, "list the events that would be retried; change nothing but the audit row")
	addSafetyFlags(retryFailed)

	cmd.AddCommand(status, retryFailed, cleanCmd("outbox"))
	cmd.AddCommand(outboxSwitchCmds()...)
	return cmd
}

// runOutboxStatus is `outbox status`.
func runOutboxStatus(cmd *cobra.Command, _ []string) error {
	pool, err := openPool(cmd)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx := cmd.Context()
	db := pool.handle()
	total, err := outbox.ReadStats(ctx, db)
	if err != nil {
		return err
	}
	topics, err := outbox.ReadTopicStats(ctx, db)
	if err != nil {
		return err
	}
	nProblems, _ := cmd.Flags().GetInt("problems")
	if nProblems < 0 {
		return fmt.Errorf("--problems %d: want 0 (none) or more", nProblems)
	}
	var problems []outbox.ProblemEvent
	if nProblems > 0 {
		if problems, err = outbox.ReadProblems(ctx, db, nProblems); err != nil {
			return err
		}
	}
	out := cmd.OutOrStdout()
	if asJSON, _ := cmd.Flags().GetBool("json"); asJSON {
		enc := json.NewEncoder(out)
		for _, t := range topics {
			if err := enc.Encode(map[string]any{"topic": t.Topic, "pending": t.Pending, "oldest_pending_age_seconds": t.OldestPendingAge.Seconds(), "failed": t.Failed}); err != nil {
				return err
			}
		}
		recent := make([]map[string]any, 0, len(problems))
		for _, p := range problems {
			recent = append(recent, map[string]any{"id": p.ID, "event_id": p.EventID, "topic": p.Topic, "aggregate_id": p.AggregateID,
				"status": problemStatus(p), "attempts": p.RetryCount, "last_error": p.LastError, "created_at": p.CreatedAt})
		}
		return enc.Encode(map[string]any{"topic": "*", "pending": total.Pending, "oldest_pending_age_seconds": total.OldestPendingAge.Seconds(), "failed": total.Failed, "problems": recent})
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tPENDING\tOLDEST PENDING\tFAILED")
	for _, t := range topics {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\n", t.Topic, t.Pending, t.OldestPendingAge.Round(time.Millisecond), t.Failed)
	}
	fmt.Fprintf(tw, "(all)\t%d\t%s\t%d\n", total.Pending, total.OldestPendingAge.Round(time.Millisecond), total.Failed)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(problems) > 0 {
		fmt.Fprintf(out, "\nfailed and retrying events (the %d most recent failed, the %d with the most attempts):\n", nProblems, nProblems)
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSTATUS\tTOPIC\tEVENT ID\tATTEMPTS\tAGE\tLAST ERROR")
		now := time.Now()
		for _, p := range problems {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", p.ID, problemStatus(p), p.Topic, p.EventID, p.RetryCount,
				now.Sub(p.CreatedAt).Round(time.Second), oneLine(p.LastError, 160))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if total.Failed > 0 {
		fmt.Fprintln(out, "failed events wait for `millwright outbox retry-failed` (try --dry-run first)")
	}
	return nil
}

// runRetryFailed is `outbox retry-failed`.
func runRetryFailed(cmd *cobra.Command, args []string) error {
	topic, _ := cmd.Flags().GetString("topic")
	ids, _ := cmd.Flags().GetInt64Slice("id")
	dry, _ := cmd.Flags().GetBool("dry-run")
	change, pool, err := openChange(cmd, args)
	if err != nil {
		return err
	}
	defer pool.Close()
	filter := outbox.FailedFilter{Topic: topic, IDs: ids}
	err = change.confirm(func() (string, error) {
		evs, err := retryFailedOn(cmd.Context(), pool, filter, true, nil)
		if err != nil {
			return "", err
		}
		var b strings.Builder
		printFailedEvents(&b, evs)
		fmt.Fprintf(&b, "%d failed event(s) will go back to pending", len(evs))
		return firstLines(b.String(), 20), nil
	})
	if err != nil {
		return err
	}
	evs, err := retryFailed(cmd, pool, filter, dry)
	if err != nil {
		return change.finish(0, err)
	}
	out := cmd.OutOrStdout()
	if err := printFailedEvents(out, evs); err != nil {
		return change.finish(int64(len(evs)), err)
	}
	if dry {
		fmt.Fprintf(out, "dry run: %d failed event(s) would be retried\n", len(evs))
	} else {
		fmt.Fprintf(out, "%d failed event(s) back to pending\n", len(evs))
	}
	return change.finish(int64(len(evs)), nil)
}

// problemStatus names a ProblemEvent's state in `outbox status`.
func problemStatus(p outbox.ProblemEvent) string {
	if p.Failed {
		return "failed"
	}
	return "retrying"
}

// printFailedEvents lists failed outbox events as a table.
func printFailedEvents(out io.Writer, evs []outbox.FailedEvent) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tEVENT ID\tTOPIC\tAGGREGATE\tATTEMPTS\tLAST ERROR")
	for _, e := range evs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", e.ID, e.EventID, e.Topic, e.AggregateID, e.RetryCount, oneLine(e.LastError, 80))
	}
	return tw.Flush()
}

func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n-3] + "..."
	}
	return s
}

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
	addDatabaseFlag(cmd)
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	cmd.Flags().Int("rounds", 3, "runs per figure; the median is reported")
	cmd.Flags().Int("writes", 2000, "transactions per write-overhead run")
	cmd.Flags().Int("backlog", 100000, "events per drain run (at tens of thousands of events/s a smaller backlog drains in under a second, and the figures measure start-up and noise)")
	cmd.Flags().Int("aggregates", 1000, "aggregates the drain's backlog is spread over")
	cmd.Flags().Int("hot", 0, "percent of the drain's backlog on one more aggregate (0..100; one lane, so one relay publishes those)")
	cmd.Flags().IntSlice("relays", []int{1, 2}, "relay counts of the drain; the bare loop runs at the same counts")
	cmd.Flags().Int("published-rows", 1000000, "published rows for the claim and retention sections (0 skips them)")
	cmd.Flags().StringSlice("kinds", []string{"gochannel", "kafka"}, "transports for drain and latency: gochannel, kafka, googlecloud, amqp, sql")
	addBenchBrokerFlags(cmd)
	cmd.Flags().Int("rate", 200, "events/s for the latency run")
	cmd.Flags().Duration("latency-duration", 5*time.Second, "length of each latency run")
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
		PublishedRows: published, Rate: rate, LatencyDuration: latDur, Sections: sections, Group: sinkGroup,
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
		kinds, err := benchKinds("outbox", kindFlag, transport.GoChannel, transport.Kafka, transport.GoogleCloud, transport.AMQP, transport.SQL)
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
	_, schemaURL, drop, err := benchdb.Scratch(ctx, admin, databaseURL(flagURL), "mw_bench")
	if err != nil {
		return err
	}
	defer drop()
	// Named, so that the latency section tells its own sessions holding
	// the xmin horizon from the server's other sessions.
	schemaURL = withDSNParam(schemaURL, "application_name", outboxbench.AppName)
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
