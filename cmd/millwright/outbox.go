package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
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
		RunE: func(cmd *cobra.Command, _ []string) error {
			db, err := openDB(cmd)
			if err != nil {
				return err
			}
			defer db.Close()
			ctx := cmd.Context()
			total, err := outbox.ReadStats(ctx, db)
			if err != nil {
				return err
			}
			topics, err := outbox.ReadTopicStats(ctx, db)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON, _ := cmd.Flags().GetBool("json"); asJSON {
				enc := json.NewEncoder(out)
				for _, t := range topics {
					if err := enc.Encode(map[string]any{"topic": t.Topic, "pending": t.Pending, "oldest_pending_age_seconds": t.OldestPendingAge.Seconds(), "failed": t.Failed}); err != nil {
						return err
					}
				}
				return enc.Encode(map[string]any{"topic": "*", "pending": total.Pending, "oldest_pending_age_seconds": total.OldestPendingAge.Seconds(), "failed": total.Failed})
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
			if total.Failed > 0 {
				fmt.Fprintln(out, "failed events wait for `millwright outbox retry-failed` (try --dry-run first)")
			}
			return nil
		},
	}
	addDatabaseFlag(status)
	status.Flags().Bool("json", false, "print one JSON object per topic, then the total")

	retryFailed := &cobra.Command{
		Use:   "retry-failed",
		Short: "Put failed events back to pending with a fresh retry budget",
		Long: `Puts the outbox rows in the failed state (those that exhausted their
publish attempts) back to pending with a fresh retry budget, and wakes the
relays. --topic and --id narrow the selection; --dry-run only lists it. On a
terminal it shows the selection and asks to confirm; elsewhere --yes is
required. Every run is recorded in millwright_audit.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			topic, _ := cmd.Flags().GetString("topic")
			ids, _ := cmd.Flags().GetInt64Slice("id")
			dry, _ := cmd.Flags().GetBool("dry-run")
			change, db, err := openChange(cmd, args)
			if err != nil {
				return err
			}
			defer db.Close()
			ctx := cmd.Context()
			filter := outbox.FailedFilter{Topic: topic, IDs: ids}
			err = change.confirm(func() (string, error) {
				evs, err := outbox.RetryFailed(ctx, db, filter, true)
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
			evs, err := outbox.RetryFailed(ctx, db, filter, dry)
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
		},
	}
	addDatabaseFlag(retryFailed)
	retryFailed.Flags().String("topic", "", "retry only this topic's failed events")
	retryFailed.Flags().Int64Slice("id", nil, "retry only these row ids (repeat or comma-separate)")
	retryFailed.Flags().Bool("dry-run", false, "list the events that would be retried, change nothing")
	addSafetyFlags(retryFailed)

	cmd.AddCommand(status, retryFailed, cleanCmd("outbox"))
	return cmd
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
                   is of mean latencies;
  drain            time for relays to publish a --backlog of events spread
                   over 1,000 aggregates, with 1 and 2 relays, beside a bare
                   loop (SKIP LOCKED batch of 100, publish, one UPDATE, all
                   in one transaction) on the same publisher, per --kinds;
  claim            one relay round (claim, no-op publish, mark) with nothing
                   due and with 100 rows due, on an empty table and on one
                   holding --published-rows published rows;
  latency          commit-to-consumer p50/p99 at --rate events/s with LISTEN
                   wake-up and a 1 s poll fallback, per --kinds.

Every figure is the median of --rounds runs. Kinds: gochannel, kafka (a
real cluster with --kafka-brokers, else an embedded kfake), googlecloud (a
Pub/Sub emulator with --pubsub-emulator, else an embedded pstest), amqp
(--amqp-url), sql (the same Postgres). Each drain and latency row names the
broker it ran on.`,
		RunE: runBenchOutbox,
	}
	addDatabaseFlag(cmd)
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	cmd.Flags().Int("rounds", 3, "runs per figure; the median is reported")
	cmd.Flags().Int("writes", 2000, "transactions per write-overhead run")
	cmd.Flags().Int("backlog", 20000, "events per drain run")
	cmd.Flags().Int("published-rows", 1000000, "published rows for the claim benchmark (0 skips it)")
	cmd.Flags().StringSlice("kinds", []string{"gochannel", "kafka"}, "transports for drain and latency: gochannel, kafka, googlecloud, amqp, sql")
	addBenchBrokerFlags(cmd)
	cmd.Flags().Int("rate", 200, "events/s for the latency run")
	cmd.Flags().Duration("latency-duration", 5*time.Second, "length of each latency run")
	cmd.Flags().StringSlice("sections", []string{"write", "drain", "claim", "latency"}, "which parts to run")
	return cmd
}

// outboxBenchRow is one line of the table, and one object with --json.
type outboxBenchRow struct {
	Bench    string  `json:"bench"`
	Case     string  `json:"case"`
	Variant  string  `json:"variant"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Baseline float64 `json:"baseline,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"`
	Target   string  `json:"target,omitempty"`
	// Broker is what a drain or latency row ran on (benchBroker.Label:
	// "kfake", "kafka 127.0.0.1:9092", ...); empty for the Postgres-only
	// sections.
	Broker string `json:"broker,omitempty"`
	// VsForwarder is Value over Watermill's forwarder in the same run.
	VsForwarder float64 `json:"vs_forwarder,omitempty"`
	// VsPublisher is Value over the transport's Watermill publisher alone,
	// without a database, in the same run.
	VsPublisher float64   `json:"vs_publisher,omitempty"`
	Runs        []float64 `json:"runs"`
}

type outboxBench struct {
	db      *sql.DB
	url     string
	rounds  int
	payload []byte
	out     io.Writer
	asJSON  bool
	rows    []outboxBenchRow
	cleanup []func()
	// broker labels the rows of the section withTransport runs; empty
	// outside it.
	broker string
	// topics are the broker topics the section created, dropped after it
	// on a real Kafka.
	topics []string
}

func (b *outboxBench) emit(r outboxBenchRow) {
	r.Bench = "outbox"
	r.Broker = b.broker
	if b.asJSON {
		_ = json.NewEncoder(b.out).Encode(r)
	}
	b.rows = append(b.rows, r)
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func runBenchOutbox(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	rounds, _ := cmd.Flags().GetInt("rounds")
	writes, _ := cmd.Flags().GetInt("writes")
	backlog, _ := cmd.Flags().GetInt("backlog")
	published, _ := cmd.Flags().GetInt("published-rows")
	kindFlag, _ := cmd.Flags().GetStringSlice("kinds")
	rate, _ := cmd.Flags().GetInt("rate")
	latDur, _ := cmd.Flags().GetDuration("latency-duration")
	sections, _ := cmd.Flags().GetStringSlice("sections")
	asJSON, _ := cmd.Flags().GetBool("json")
	if rounds < 1 || writes < 1 || backlog < 1 || rate < 1 || published < 0 {
		return errors.New("bench outbox: --rounds, --writes, --backlog and --rate must be at least 1, --published-rows at least 0")
	}
	want := map[string]bool{}
	for _, s := range sections {
		want[s] = true
	}
	var kinds []transport.Kind
	var brokers benchBrokers
	if want["drain"] || want["latency"] {
		var err error
		kinds, err = benchKinds("outbox", kindFlag, transport.GoChannel, transport.Kafka, transport.GoogleCloud, transport.AMQP, transport.SQL)
		if err != nil {
			return err
		}
		if brokers, err = benchBrokersFromFlags(cmd); err != nil {
			return err
		}
		for _, l := range brokers.notice(kinds) {
			fmt.Fprintln(cmd.ErrOrStderr(), l)
		}
	}

	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	flagURL, _ := cmd.Flags().GetString("database-url")
	_, schemaURL, drop, err := scratchSchema(ctx, admin, databaseURL(flagURL), "mw_bench")
	if err != nil {
		return err
	}
	defer drop()
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(24)
	db.SetMaxIdleConns(24)
	if _, err := migrate.Up(ctx, db, outbox.Migrations()); err != nil {
		return err
	}

	payload := []byte(`{"order_id":"00000000-0000-0000-0000-000000000000","customer":"c-000000","currency":"EUR","items":[{"sku":"sku-0001","qty":1,"price":1999},{"sku":"sku-0002","qty":2,"price":599}],"note":"`)
	for len(payload) < 297 {
		payload = append(payload, 'x')
	}
	payload = append(payload, `"}`...)
	b := &outboxBench{db: db, url: schemaURL, rounds: rounds, payload: payload, out: cmd.OutOrStdout(), asJSON: asJSON}
	defer func() {
		for _, f := range b.cleanup {
			f()
		}
	}()

	progress := func(format string, args ...any) {
		if !asJSON {
			fmt.Fprintf(cmd.ErrOrStderr(), format+"\n", args...)
		}
	}
	if want["write"] {
		progress("write overhead ...")
		if err := b.benchWrite(ctx, writes); err != nil {
			return fmt.Errorf("write overhead: %w", err)
		}
	}
	if want["drain"] {
		for _, k := range kinds {
			progress("drain via %s ...", k)
			if err := b.withTransport(ctx, brokers, k, func(t *transport.Transport) error { return b.benchDrain(ctx, string(k), t, backlog) }); err != nil {
				// One broker being unavailable does not void the others.
				fmt.Fprintf(cmd.ErrOrStderr(), "drain via %s: %v (skipped)\n", k, err)
			}
		}
	}
	if want["claim"] && published > 0 {
		progress("claim cost (inserting %d published rows) ...", published)
		if err := b.benchClaim(ctx, published); err != nil {
			return fmt.Errorf("claim: %w", err)
		}
	}
	if want["latency"] {
		for _, k := range kinds {
			progress("latency via %s ...", k)
			if err := b.withTransport(ctx, brokers, k, func(t *transport.Transport) error { return b.benchLatency(ctx, string(k), t, rate, latDur) }); err != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "latency via %s: %v (skipped)\n", k, err)
			}
		}
	}
	if asJSON {
		return nil
	}
	tw := tabwriter.NewWriter(b.out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "CASE\tBROKER\tVARIANT\tVALUE\tUNIT\tBASELINE\tRATIO\tVS FORWARDER\tVS PUBLISHER\tTARGET\n")
	for _, r := range b.rows {
		base, ratio, vsf, vsp := "", "", "", ""
		if r.VsForwarder != 0 {
			vsf = strconv.FormatFloat(r.VsForwarder, 'f', 2, 64) + "x"
		}
		if r.VsPublisher != 0 {
			vsp = strconv.FormatFloat(r.VsPublisher, 'f', 2, 64) + "x"
		}
		if r.Baseline != 0 {
			base = strconv.FormatFloat(r.Baseline, 'f', 2, 64)
		}
		if r.Ratio != 0 {
			ratio = strconv.FormatFloat(r.Ratio, 'f', 2, 64) + "x"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.2f\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Case, dash(r.Broker), r.Variant, r.Value, r.Unit, base, ratio, vsf, vsp, r.Target)
	}
	fmt.Fprintf(tw, "(medians of %d runs)\n", rounds)
	return tw.Flush()
}

// withTransport opens a transport of the given kind for one section, on
// the broker the flags chose (a fresh fake per section when none is real),
// and labels the section's rows with it.
func (b *outboxBench) withTransport(ctx context.Context, brokers benchBrokers, kind transport.Kind, f func(*transport.Transport) error) error {
	defer func() { b.broker, b.topics = "", nil }() // last: after dropTopics
	var cfg transport.Config
	switch kind {
	case transport.SQL:
		cfg = transport.Config{Kind: transport.SQL}
		cfg.SQL.DB = b.db
		// watermill-sql's subscriber has no wake-up: it polls. At its
		// default 100 ms the latency rows would show that poll, not the
		// relay's part; the forwarder is measured with the same consumer.
		cfg.SQL.PollInterval = sqlConsumerPoll
		b.broker = postgresLabel(b.url)
	default:
		br, err := brokers.open(kind)
		if err != nil {
			return err
		}
		defer br.Close()
		defer func() { br.dropTopics(context.WithoutCancel(ctx), b.topics...) }()
		cfg, b.broker = br.Config, br.Label
		cfg.AMQP.DeclareGroups = []string{sinkGroup}
		cfg.GoogleCloud.DeclareGroups = []string{sinkGroup}
		if kind == transport.GoChannel {
			// Nothing subscribes to the drain topic: keep gochannel from
			// holding every message for a subscriber that never comes.
			cfg.GoChannel.NotPersistent = true
		}
	}
	t, err := transport.Open(ctx, cfg)
	if err != nil {
		return err
	}
	defer t.Close()
	return f(t)
}

// Write-overhead variants: the same business transaction (BEGIN, insert an
// order row, COMMIT) alone, with one plain extra insert (the reference the
// issue measured: about 1.3x), and with one outbox event.
const (
	writeBase = iota
	writePlain
	writeOutbox
	writeVariants
)

// benchWrite interleaves the variants transaction by transaction on every
// writer, so drift in the machine's speed (other jobs, checkpoints, the
// disk's flush time) hits them alike, and compares their mean latency.
// Separate timed runs per variant, on a shared 2-core machine, gave ratios
// from 1.2x to 1.6x for the same code.
func (b *outboxBench) benchWrite(ctx context.Context, n int) error {
	if _, err := b.db.ExecContext(ctx, `CREATE TABLE bench_orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
		CREATE TABLE bench_order_lines (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	// run returns the mean latency of each variant, in seconds.
	run := func(writers int) ([writeVariants]float64, error) {
		var next atomic.Int64
		var mu sync.Mutex
		var total [writeVariants]time.Duration
		var count [writeVariants]int
		var wg sync.WaitGroup
		errs := make(chan error, writers)
		for range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var t [writeVariants]time.Duration
				var c [writeVariants]int
				defer func() {
					mu.Lock()
					for v := range writeVariants {
						total[v] += t[v]
						count[v] += c[v]
					}
					mu.Unlock()
				}()
				for i := next.Add(1); i <= int64(n)*writeVariants; i = next.Add(1) {
					v := int(i % writeVariants)
					start := time.Now()
					if err := b.oneWrite(ctx, i, v); err != nil {
						errs <- err
						return
					}
					t[v] += time.Since(start)
					c[v]++
				}
			}()
		}
		wg.Wait()
		close(errs)
		var mean [writeVariants]float64
		if err := <-errs; err != nil {
			return mean, err
		}
		for v := range writeVariants {
			mean[v] = total[v].Seconds() / float64(count[v])
		}
		return mean, nil
	}
	for _, writers := range []int{1, 8} {
		if _, err := run(writers); err != nil { // warm-up
			return err
		}
		var rates [writeVariants][]float64
		var ratios [writeVariants][]float64
		for range b.rounds {
			mean, err := run(writers)
			if err != nil {
				return err
			}
			for v := range writeVariants {
				rates[v] = append(rates[v], float64(writers)/mean[v])
				ratios[v] = append(ratios[v], mean[v]/mean[writeBase])
			}
		}
		if _, err := b.db.ExecContext(ctx, `TRUNCATE millwright_outbox, bench_orders, bench_order_lines`); err != nil {
			return err
		}
		base := median(rates[writeBase])
		b.emit(outboxBenchRow{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row only", writers), Value: base, Unit: "tx/s", Runs: rates[writeBase]})
		b.emit(outboxBenchRow{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row + plain second insert", writers), Value: median(rates[writePlain]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writePlain]), Runs: rates[writePlain]})
		b.emit(outboxBenchRow{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row + outbox event", writers), Value: median(rates[writeOutbox]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writeOutbox]), Target: "cost <= 1.35x", Runs: rates[writeOutbox]})
	}
	return nil
}

func (b *outboxBench) oneWrite(ctx context.Context, i int64, variant int) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	cust := "c-" + strconv.FormatInt(i%5000, 10)
	if _, err := tx.ExecContext(ctx, `INSERT INTO bench_orders (customer, total) VALUES ($1, $2)`, cust, i); err != nil {
		return err
	}
	switch variant {
	case writePlain:
		// Inlined like Add's statement: one round trip with lib/pq.
		if _, err := tx.ExecContext(ctx, `INSERT INTO bench_order_lines (customer, total) VALUES (`+pq.QuoteLiteral(cust)+`, `+strconv.FormatInt(i, 10)+`)`); err != nil {
			return err
		}
	case writeOutbox:
		if err := outbox.Add(ctx, tx, outbox.Event{Topic: "orders", AggregateType: "customer", AggregateID: cust, EventType: "order.created.v1", Payload: b.payload}); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// fill truncates the outbox and writes n events over 1,000 aggregates.
func (b *outboxBench) fill(ctx context.Context, topic string, n int) error {
	if _, err := b.db.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	evs := make([]outbox.Event, 0, 1000)
	for i := 0; i < n; i++ {
		evs = append(evs, outbox.Event{Topic: topic, AggregateType: "order", AggregateID: strconv.Itoa(i % 1000), EventType: "order.created.v1", Payload: b.payload})
		if len(evs) == cap(evs) || i == n-1 {
			if err := outbox.Add(ctx, b.db, evs...); err != nil {
				return err
			}
			evs = evs[:0]
		}
	}
	_, err := b.db.ExecContext(ctx, `ANALYZE millwright_outbox`)
	return err
}

func (b *outboxBench) waitDrained(ctx context.Context, timeout time.Duration) error {
	// A cheap probe, not a count: the poll must not slow the relays down.
	deadline := time.Now().Add(timeout)
	for {
		var pending bool
		if err := b.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM millwright_outbox WHERE status = 'pending')`).Scan(&pending); err != nil {
			return err
		}
		if !pending {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not drained after %s", timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (b *outboxBench) benchDrain(ctx context.Context, kind string, t *transport.Transport, n int) error {
	pub := t.Publisher()
	// A topic per run: on a real broker an earlier run's would still hold
	// its events.
	topic := fmt.Sprintf("bench_outbox_drain_%d", time.Now().UnixNano())
	b.topics = append(b.topics, topic)
	variants := []struct {
		name string
		run  func() error
	}{
		{"bare loop (batch 100, tx across publish)", func() error { return bareLoop(ctx, b.db, pub) }},
	}
	for _, relays := range []int{1, 2} {
		variants = append(variants, struct {
			name string
			run  func() error
		}{fmt.Sprintf("outbox relay x%d", relays), func() error {
			var rs []*outbox.Relay
			var wg sync.WaitGroup
			for range relays {
				r, err := outbox.NewRelay(b.db, pub, outbox.RelayConfig{})
				if err != nil {
					return err
				}
				rs = append(rs, r)
				wg.Add(1)
				go func() { defer wg.Done(); _ = r.Run(ctx) }()
			}
			err := b.waitDrained(ctx, 5*time.Minute)
			for _, r := range rs {
				_ = r.Close()
			}
			wg.Wait()
			return err
		}})
	}
	_, batched := pub.(transport.BatchPublisher)
	results := make([][]float64, len(variants)+1)
	var alone []float64
	for round := range b.rounds {
		for i, v := range variants {
			if err := b.fill(ctx, topic, n); err != nil {
				return err
			}
			start := time.Now()
			if err := v.run(); err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			results[i] = append(results[i], float64(n)/time.Since(start).Seconds())
		}
		rate, err := b.forwarderDrain(ctx, pub, fmt.Sprintf("bench_fwd_%d_%d", time.Now().UnixNano(), round), topic, n)
		if err != nil {
			return fmt.Errorf("watermill forwarder: %w", err)
		}
		results[len(variants)] = append(results[len(variants)], rate)
		rate, err = b.publisherAlone(pub, topic, n)
		if err != nil {
			return fmt.Errorf("watermill publisher alone: %w", err)
		}
		alone = append(alone, rate)
	}
	variants = append(variants, struct {
		name string
		run  func() error
	}{name: "watermill forwarder + watermill-sql (defaults)"})
	base := median(results[0])
	fwd := median(results[len(results)-1])
	pubRate := median(alone)
	for i, v := range variants {
		row := outboxBenchRow{Case: "drain " + kind, Variant: fmt.Sprintf("%s, %d events", v.name, n), Value: median(results[i]), Unit: "events/s", Runs: results[i]}
		if i > 0 {
			row.Baseline, row.Ratio = base, row.Value/base
			switch {
			case kind == "kafka":
				row.Target = map[int]string{1: ">= 15000/s", 2: ">= 20000/s"}[i]
			case i <= 2 && (kind == "amqp" || kind == "sql"):
				row.Target = ">= 0.50x publisher"
			}
		}
		if i < len(variants)-1 {
			row.VsForwarder = row.Value / fwd
			if batched {
				row.Variant += " (PublishBatch)"
			}
		}
		row.VsPublisher = row.Value / pubRate
		b.emit(row)
	}
	b.emit(outboxBenchRow{Case: "drain " + kind, Variant: fmt.Sprintf("watermill publisher alone, no database (Publish, 100 per call, 8 goroutines), %d events", n),
		Value: pubRate, Unit: "events/s", Runs: alone})
	return nil
}

// publisherAlone measures the transport's Watermill publisher with no
// database in the way: n messages shaped like the relay's (same payload,
// the CloudEvents metadata the relay sends), with Publish (never
// PublishBatch), 100 messages per call from 8 goroutines. It is the "what
// Watermill's own publisher reaches on that broker" the relay is compared
// with.
func (b *outboxBench) publisherAlone(pub message.Publisher, topic string, n int) (float64, error) {
	msgs := make([]*message.Message, n)
	now := time.Now().UTC().Format(time.RFC3339Nano)
	for i := range msgs {
		id := watermill.NewUUID()
		agg := "a-" + strconv.Itoa(i%1000)
		m := message.NewMessage(id, b.payload)
		for k, v := range map[string]string{metadata.EventID: id, metadata.EventSpecVersion: "1.0", metadata.EventTime: now,
			metadata.EventSubject: agg, metadata.AggregateID: agg, metadata.AggregateType: "bench", metadata.OrderingKey: "bench/" + agg,
			metadata.EventType: "bench.event.v1", metadata.EventDataContentType: "application/json"} {
			m.Metadata.Set(k, v)
		}
		msgs[i] = m
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	start := time.Now()
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				from := int(next.Add(100)) - 100
				if from >= n {
					return
				}
				if err := pub.Publish(topic, msgs[from:min(from+100, n)]...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// countingPublisher counts what the forwarder sends and signals when n
// messages went out.
type countingPublisher struct {
	message.Publisher
	n    int64
	sent atomic.Int64
	done chan struct{}
	once sync.Once
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if p.sent.Add(int64(len(msgs))) >= p.n {
		p.once.Do(func() { close(p.done) })
	}
	return nil
}

// forwarderDrain measures Watermill's own outbox on the same backlog:
// events written through forwarder.NewPublisher over watermill-sql, then
// forwarded to pub by forwarder.NewForwarder with its defaults.
func (b *outboxBench) forwarderDrain(ctx context.Context, pub message.Publisher, fwdTopic, topic string, n int) (float64, error) {
	logger := watermill.NopLogger{}
	sqlPub, err := wsql.NewPublisher(b.db, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		return 0, err
	}
	fwdPub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
	for i := 0; i < n; i += 1000 {
		msgs := make([]*message.Message, 0, 1000)
		for j := i; j < min(i+1000, n); j++ {
			m := message.NewMessage(watermill.NewUUID(), b.payload)
			m.Metadata.Set(transport.OrderingKey, strconv.Itoa(j%1000))
			msgs = append(msgs, m)
		}
		if err := fwdPub.Publish(topic, msgs...); err != nil {
			return 0, err
		}
	}
	sub, err := wsql.NewSubscriber(b.db, wsql.SubscriberConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		return 0, err
	}
	out := &countingPublisher{Publisher: pub, n: int64(n), done: make(chan struct{})}
	fwd, err := forwarder.NewForwarder(sub, out, logger, forwarder.Config{ForwarderTopic: fwdTopic})
	if err != nil {
		return 0, err
	}
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- fwd.Run(ctx) }()
	select {
	case <-out.done:
	case err := <-errc:
		return 0, fmt.Errorf("forwarder stopped: %v", err)
	case <-time.After(5 * time.Minute):
		return 0, errors.New("forwarder did not drain within 5 minutes")
	}
	rate := float64(n) / time.Since(start).Seconds()
	_ = fwd.Close()
	_ = sub.Close()
	return rate, nil
}

// bareLoop is the hand-written relay the issue measures against: one
// transaction per batch of 100 held across the publish, no ordering, no
// retries, no metrics.
func bareLoop(ctx context.Context, db *sql.DB, pub message.Publisher) error {
	bp, batched := pub.(transport.BatchPublisher)
	for {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `SELECT id, event_id, topic, aggregate_id, payload::text FROM millwright_outbox WHERE status = 'pending' ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED`)
		if err != nil {
			tx.Rollback() //nolint:errcheck
			return err
		}
		var ids []int64
		var msgs []*message.Message
		var topic string
		for rows.Next() {
			var id int64
			var eid, agg, p string
			if err := rows.Scan(&id, &eid, &topic, &agg, &p); err != nil {
				rows.Close()
				tx.Rollback() //nolint:errcheck
				return err
			}
			m := message.NewMessage(eid, []byte(p))
			m.Metadata.Set(transport.OrderingKey, agg)
			ids, msgs = append(ids, id), append(msgs, m)
		}
		rows.Close()
		if len(ids) == 0 {
			return tx.Commit()
		}
		if batched {
			err = bp.PublishBatch(topic, msgs...)
		} else {
			err = pub.Publish(topic, msgs...)
		}
		if err != nil {
			tx.Rollback() //nolint:errcheck
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE id = ANY($1)`, pq.Array(ids)); err != nil {
			tx.Rollback() //nolint:errcheck
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
	}
}

// discardPublisher accepts everything: the claim benchmark measures the
// database side of a relay round.
type discardPublisher struct{}

func (discardPublisher) Publish(string, ...*message.Message) error { return nil }
func (discardPublisher) Close() error                              { return nil }

func (b *outboxBench) benchClaim(ctx context.Context, published int) error {
	// Two outboxes side by side, one empty and one holding the published
	// rows, measured in alternation so that load from elsewhere on the
	// machine hits both alike.
	big, err := b.sibling(ctx, "big")
	if err != nil {
		return err
	}
	defer big.Close()
	if _, err := big.ExecContext(ctx, `INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, status, published_at, created_at)
		SELECT 'bench-' || g, 'bench_claim', 'order', (g % 100000)::text, 'order.created.v1', $2::jsonb, 'published', now() - interval '1 hour', now() - interval '1 hour'
		FROM generate_series(1, $1::int) g`, published, string(b.payload)); err != nil {
		return err
	}
	if _, err := b.db.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	for _, db := range []*sql.DB{b.db, big} {
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE millwright_outbox`); err != nil {
			return err
		}
	}
	measure := func(db *sql.DB) (idle, busy float64, err error) {
		r, err := outbox.NewRelay(db, discardPublisher{}, outbox.RelayConfig{BatchSize: 100})
		if err != nil {
			return 0, 0, err
		}
		var xs []time.Duration
		for range 100 {
			start := time.Now()
			if _, err := r.RunOnce(ctx); err != nil {
				return 0, 0, err
			}
			xs = append(xs, time.Since(start))
		}
		idle = medianDur(xs)
		xs = xs[:0]
		for i := range 30 {
			evs := make([]outbox.Event, 100)
			for j := range evs {
				evs[j] = outbox.Event{Topic: "bench_claim", AggregateID: strconv.Itoa(i*100 + j), Payload: b.payload}
			}
			if err := outbox.Add(ctx, db, evs...); err != nil {
				return 0, 0, err
			}
			start := time.Now()
			n, err := r.RunOnce(ctx)
			if err != nil {
				return 0, 0, err
			}
			if n != 100 {
				return 0, 0, fmt.Errorf("claimed %d rows, want 100", n)
			}
			xs = append(xs, time.Since(start))
		}
		return idle, medianDur(xs), nil
	}
	var idle0, busy0, idle1, busy1 []float64
	for range b.rounds {
		i0, b0, err := measure(b.db)
		if err != nil {
			return err
		}
		i1, b1, err := measure(big)
		if err != nil {
			return err
		}
		idle0, busy0 = append(idle0, i0), append(busy0, b0)
		idle1, busy1 = append(idle1, i1), append(busy1, b1)
	}
	b.emit(outboxBenchRow{Case: "claim", Variant: "round, nothing due, empty table", Value: median(idle0), Unit: "ms", Runs: idle0})
	b.emit(outboxBenchRow{Case: "claim", Variant: fmt.Sprintf("round, nothing due, %d published rows", published), Value: median(idle1), Unit: "ms",
		Baseline: median(idle0), Ratio: median(idle1) / median(idle0), Target: "<= 1.5x", Runs: idle1})
	b.emit(outboxBenchRow{Case: "claim", Variant: "round of 100 rows (claim, no-op publish, mark), empty table", Value: median(busy0), Unit: "ms", Runs: busy0})
	b.emit(outboxBenchRow{Case: "claim", Variant: fmt.Sprintf("round of 100 rows (claim, no-op publish, mark), %d published rows", published), Value: median(busy1), Unit: "ms",
		Baseline: median(busy0), Ratio: median(busy1) / median(busy0), Target: "<= 1.5x", Runs: busy1})
	return nil
}

// sibling opens a second scratch schema (name suffix) with the outbox
// migrated, dropped when the returned pool is closed.
func (b *outboxBench) sibling(ctx context.Context, suffix string) (*sql.DB, error) {
	u, err := url.Parse(b.url)
	if err != nil {
		return nil, err
	}
	q := u.Query()
	schema := q.Get("search_path") + "_" + suffix
	if _, err := b.db.ExecContext(ctx, `CREATE SCHEMA `+schema); err != nil {
		return nil, fmt.Errorf("creating scratch schema %s: %w", schema, err)
	}
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	db, err := pgconn.Open(u.String())
	if err != nil {
		return nil, err
	}
	if _, err := migrate.Up(ctx, db, outbox.Migrations()); err != nil {
		db.Close()
		return nil, err
	}
	b.cleanup = append(b.cleanup, func() { b.db.ExecContext(context.WithoutCancel(ctx), `DROP SCHEMA `+schema+` CASCADE`) }) //nolint:errcheck // best effort
	return db, nil
}

func medianDur(xs []time.Duration) float64 {
	fs := make([]float64, len(xs))
	for i, x := range xs {
		fs[i] = float64(x) / float64(time.Millisecond)
	}
	return median(fs)
}

// sqlConsumerPoll is the poll interval of the sql kind's consumer in the
// benchmark.
const sqlConsumerPoll = 10 * time.Millisecond

func (b *outboxBench) benchLatency(ctx context.Context, kind string, t *transport.Transport, rate int, d time.Duration) error {
	if _, err := b.db.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	var p50s, p99s, fp50s, fp99s []float64
	for round := range b.rounds {
		// millwright: outbox.Add in the transaction, a relay with LISTEN
		// and a 1 s poll fallback.
		relayWrite := func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error {
			return outbox.Add(ctx, tx, outbox.Event{ID: id, Topic: topic, AggregateType: "order", AggregateID: agg, Payload: b.payload})
		}
		relayStart := func() (func(), error) {
			r, err := outbox.NewRelay(b.db, t.Publisher(), outbox.RelayConfig{ListenURL: b.url, PollInterval: time.Second})
			if err != nil {
				return nil, err
			}
			done := make(chan struct{})
			go func() { defer close(done); _ = r.Run(ctx) }()
			<-r.Running()
			return func() { _ = r.Close(); <-done }, nil
		}
		p50, p99, err := b.latencyRun(ctx, t, fmt.Sprintf("bench_outbox_latency_%d_%d", time.Now().UnixNano(), round), rate, d, relayWrite, relayStart)
		if err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		p50s, p99s = append(p50s, p50), append(p99s, p99)

		// Watermill: forwarder.NewPublisher over a watermill-sql publisher
		// on the transaction, forwarder.NewForwarder with its defaults (a
		// watermill-sql subscriber polling every second).
		fwdTopic := fmt.Sprintf("bench_fwd_latency_%d_%d", time.Now().UnixNano(), round)
		fwdWrite := func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error {
			sp, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, watermill.NopLogger{})
			if err != nil {
				return err
			}
			m := message.NewMessage(id, b.payload)
			m.Metadata.Set(transport.OrderingKey, agg)
			return forwarder.NewPublisher(sp, forwarder.PublisherConfig{ForwarderTopic: fwdTopic}).Publish(topic, m)
		}
		fwdStart := func() (func(), error) {
			sub, err := wsql.NewSubscriber(b.db, wsql.SubscriberConfig{
				SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
			}, watermill.NopLogger{})
			if err != nil {
				return nil, err
			}
			// The forwarder topic's table, created outside the writers'
			// transactions.
			if err := sub.SubscribeInitialize(fwdTopic); err != nil {
				_ = sub.Close()
				return nil, err
			}
			fwd, err := forwarder.NewForwarder(sub, t.Publisher(), watermill.NopLogger{}, forwarder.Config{ForwarderTopic: fwdTopic})
			if err != nil {
				_ = sub.Close()
				return nil, err
			}
			done := make(chan struct{})
			go func() { defer close(done); _ = fwd.Run(ctx) }()
			<-fwd.Running()
			return func() { _ = fwd.Close(); <-done; _ = sub.Close() }, nil
		}
		p50, p99, err = b.latencyRun(ctx, t, fmt.Sprintf("bench_fwd_latency_out_%d_%d", time.Now().UnixNano(), round), rate, d, fwdWrite, fwdStart)
		if err != nil {
			return fmt.Errorf("watermill forwarder: %w", err)
		}
		fp50s, fp99s = append(fp50s, p50), append(fp99s, p99)
	}
	consumer := ""
	if kind == "sql" {
		consumer = fmt.Sprintf(" (consumer polls every %s)", sqlConsumerPoll)
	}
	b.emit(outboxBenchRow{Case: "latency " + kind, Variant: fmt.Sprintf("outbox relay: commit to consumer p50 at %d/s, LISTEN + 1s poll%s", rate, consumer), Value: median(p50s), Unit: "ms", Runs: p50s})
	b.emit(outboxBenchRow{Case: "latency " + kind, Variant: fmt.Sprintf("outbox relay: commit to consumer p99 at %d/s, LISTEN + 1s poll%s", rate, consumer), Value: median(p99s), Unit: "ms", Target: "<= 25 ms", Runs: p99s})
	b.emit(outboxBenchRow{Case: "latency " + kind, Variant: fmt.Sprintf("watermill forwarder (defaults, 1s poll): commit to consumer p50 at %d/s%s", rate, consumer), Value: median(fp50s), Unit: "ms", Runs: fp50s})
	b.emit(outboxBenchRow{Case: "latency " + kind, Variant: fmt.Sprintf("watermill forwarder (defaults, 1s poll): commit to consumer p99 at %d/s%s", rate, consumer), Value: median(fp99s), Unit: "ms", Runs: fp99s})
	return nil
}

// latencyRun writes events at rate per second for d, each in its own
// transaction through write, while the relaying side started by start
// forwards them to topic on t, and returns the p50 and p99 of the time
// from Commit's return to the consumer's receipt, in milliseconds.
func (b *outboxBench) latencyRun(ctx context.Context, t *transport.Transport, topic string, rate int, d time.Duration,
	write func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error, start func() (stop func(), err error)) (p50, p99 float64, err error) {
	b.topics = append(b.topics, topic)
	sub, err := t.Subscriber(sinkGroup)
	if err != nil {
		return 0, 0, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := sub.Subscribe(sctx, topic)
	if err != nil {
		return 0, 0, err
	}
	var committed sync.Map // event ids written
	var mu sync.Mutex
	received := map[string]time.Time{}
	commitDone := map[string]time.Time{}
	warm := make(chan struct{}, 1)
	go func() {
		for m := range ch {
			now := time.Now()
			if _, ok := committed.Load(m.UUID); ok {
				mu.Lock()
				received[m.UUID] = now
				mu.Unlock()
			} else {
				select {
				case warm <- struct{}{}:
				default:
				}
			}
			m.Ack()
		}
	}()
	stop, err := start()
	if err != nil {
		return 0, 0, err
	}
	defer stop()
	writeOne := func(id, agg string) error {
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := write(ctx, tx, topic, id, agg); err != nil {
			tx.Rollback() //nolint:errcheck
			return err
		}
		return tx.Commit()
	}
	// Warm up until the subscriber receives (consumer group joins).
	warmDeadline := time.Now().Add(60 * time.Second)
warmup:
	for {
		if err := writeOne(watermill.NewUUID(), "warmup"); err != nil {
			return 0, 0, err
		}
		select {
		case <-warm:
			break warmup
		case <-time.After(time.Second):
			if time.Now().After(warmDeadline) {
				return 0, 0, errors.New("subscriber received nothing within 60s")
			}
		}
	}
	interval := time.Second / time.Duration(rate)
	total := int(d / interval)
	tick := time.NewTicker(interval)
	for i := range total {
		<-tick.C
		id := watermill.NewUUID()
		// Marked known before COMMIT (the event may arrive before Commit
		// returns); latency counts from Commit's return, 0 for an event
		// that arrived earlier.
		committed.Store(id, true)
		if err := writeOne(id, strconv.Itoa(i%100)); err != nil {
			tick.Stop()
			return 0, 0, err
		}
		mu.Lock()
		commitDone[id] = time.Now()
		mu.Unlock()
	}
	tick.Stop()
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		got := len(received)
		mu.Unlock()
		if got >= total || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	var xs []time.Duration
	for id, at := range received {
		xs = append(xs, max(at.Sub(commitDone[id]), 0))
	}
	if len(xs) < total {
		return 0, 0, fmt.Errorf("received %d of %d events within 30s", len(xs), total)
	}
	sort.Slice(xs, func(i, j int) bool { return xs[i] < xs[j] })
	return float64(xs[len(xs)/2]) / float64(time.Millisecond), float64(xs[len(xs)*99/100]) / float64(time.Millisecond), nil
}
