package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
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
			db, err := openDB(cmd)
			if err != nil {
				return err
			}
			defer db.Close()
			rows, err := saga.List(cmd.Context(), db, f)
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
			db, err := openDB(cmd)
			if err != nil {
				return err
			}
			defer db.Close()
			in, hist, err := saga.Get(cmd.Context(), db, args[0])
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
--dry-run prints what would be done and changes nothing. On a terminal it
shows the resolution and asks to confirm; elsewhere --yes is required. Every
run is recorded in millwright_audit.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			action, _ := cmd.Flags().GetString("action")
			note, _ := cmd.Flags().GetString("note")
			dry, _ := cmd.Flags().GetBool("dry-run")
			change, db, err := openChange(cmd, args)
			if err != nil {
				return err
			}
			defer db.Close()
			ctx := cmd.Context()
			out := cmd.OutOrStdout()
			if dry {
				r, err := saga.Resolve(ctx, db, args[0], saga.ResolveAction(action), note, true)
				if err != nil {
					return change.finish(0, err)
				}
				fmt.Fprintf(out, "dry run: would %s (saga %s, type %s)\n", r.Description, r.Info.ID, r.Info.Type)
				return change.finish(1, nil)
			}
			err = change.confirm(func() (string, error) {
				r, err := saga.Resolve(ctx, db, args[0], saga.ResolveAction(action), note, true)
				if err != nil {
					return "", err
				}
				return fmt.Sprintf("will %s (saga %s, type %s)", r.Description, r.Info.ID, r.Info.Type), nil
			})
			if err != nil {
				return err
			}
			r, err := saga.Resolve(ctx, db, args[0], saga.ResolveAction(action), note, false)
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
	cmd.Flags().Bool("dry-run", false, "print what would be done and change nothing")
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

func benchSagaCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "saga",
		Short: "Completed 3-step sagas per second and p50/p99 saga duration (Postgres + gochannel, Kafka, Pub/Sub)",
		Long: `Starts --sagas sagas of three steps (reserve, charge, ship), each in its own
transaction, from --starters goroutines, and waits until every one has
completed. Participants are in-process handlers that answer at once; commands
go through the outbox relay, replies through the transport, and the
orchestrator consumes them behind the idempotency middleware. Runs in a
scratch schema per transport kind (dropped at the end), on topics named
after it. gochannel is the baseline without a broker; kafka is a real
cluster with --kafka-brokers, else franz-go's in-process kfake; googlecloud
is a Pub/Sub emulator with --pubsub-emulator, else the in-process pstest
(which delivers at most about 800 msg/s). Each row names its broker.

Two runs per kind: "throughput" starts all sagas as fast as the starters can
(durations then include queueing), "latency" starts --latency-sagas at
--latency-rate sagas/s, below capacity, so durations show one saga's path.
Figures: sagas/s = sagas / (first start .. last completion); duration = start
to completion per saga (created_at to the completed history entry).
For scale: dtm reports 575 global transactions/s on a 4-core MySQL host.`,
		Args: cobra.NoArgs,
		RunE: runBenchSaga,
	}
	addDatabaseFlag(cmd)
	cmd.Flags().Int("sagas", 2000, "sagas per run")
	cmd.Flags().Int("starters", 16, "goroutines starting sagas")
	cmd.Flags().StringSlice("kinds", []string{"gochannel", "kafka"}, "transports: gochannel, kafka, googlecloud")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	addBenchBrokerFlags(cmd)
	cmd.Flags().Duration("timeout", 5*time.Minute, "give up a run after this long")
	cmd.Flags().Int("latency-sagas", 200, "sagas in the latency run (0 skips it)")
	cmd.Flags().Float64("latency-rate", 20, "sagas started per second in the latency run")
	cmd.Flags().Bool("keep-schema", false, "keep each run's scratch schema (printed) for inspection")
	return cmd
}

type sagaBenchResult struct {
	kind, mode    string
	broker        string // benchBroker.Label
	n             int
	rate          float64
	p50, p99, max float64 // milliseconds
	elapsed       time.Duration
	schema        string
}

func runBenchSaga(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	n, _ := cmd.Flags().GetInt("sagas")
	starters, _ := cmd.Flags().GetInt("starters")
	kindFlag, _ := cmd.Flags().GetStringSlice("kinds")
	asJSON, _ := cmd.Flags().GetBool("json")
	timeout, _ := cmd.Flags().GetDuration("timeout")
	keep, _ := cmd.Flags().GetBool("keep-schema")
	latN, _ := cmd.Flags().GetInt("latency-sagas")
	latRate, _ := cmd.Flags().GetFloat64("latency-rate")
	if n < 1 || starters < 1 || latN < 0 || latRate <= 0 {
		return errors.New("bench saga: --sagas and --starters must be at least 1, --latency-sagas at least 0, --latency-rate above 0")
	}
	// Not amqp or sql: each run would leave its queues or tables behind on
	// the server, and neither has been tried here.
	kinds, err := benchKinds("saga", kindFlag, transport.GoChannel, transport.Kafka, transport.GoogleCloud)
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
	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	flagURL, _ := cmd.Flags().GetString("database-url")
	type run struct {
		mode string
		n    int
		rate float64
	}
	runs := []run{{"throughput", n, 0}}
	if latN > 0 {
		runs = append(runs, run{"latency", latN, latRate})
	}
	var results []sagaBenchResult
	for _, kind := range kinds {
		for _, rn := range runs {
			fmt.Fprintf(cmd.ErrOrStderr(), "%s %s: %d sagas ...\n", kind, rn.mode, rn.n)
			rctx, cancel := context.WithTimeout(ctx, timeout)
			r, err := benchSagaKind(rctx, admin, databaseURL(flagURL), brokers, kind, rn.n, starters, rn.rate, keep)
			cancel()
			if err != nil {
				return fmt.Errorf("bench saga %s %s: %w", kind, rn.mode, err)
			}
			r.mode = rn.mode
			results = append(results, r)
		}
	}
	base := map[string]sagaBenchResult{}
	for _, r := range results {
		if r.kind == string(transport.GoChannel) {
			base[r.mode] = r
		}
	}
	// vsBase is the row's rate (throughput) or p50 (latency) over
	// gochannel's in the same process; 0 without a gochannel run.
	vsBase := func(r sagaBenchResult) float64 {
		b, ok := base[r.mode]
		switch {
		case !ok:
			return 0
		case r.mode == "throughput":
			return r.rate / b.rate
		default:
			return r.p50 / b.p50
		}
	}
	out := cmd.OutOrStdout()
	if asJSON {
		enc := json.NewEncoder(out)
		for _, r := range results {
			row := sagaBenchRow{Bench: "saga", Kind: r.kind, Broker: r.broker, Run: r.mode, Sagas: r.n,
				Rate: r.rate, P50: r.p50, P99: r.p99, Max: r.max, VsGoChannel: vsBase(r)}
			if keep {
				row.Schema = r.schema
			}
			if err := enc.Encode(row); err != nil {
				return err
			}
		}
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "TRANSPORT\tBROKER\tRUN\tSAGAS\tSAGAS/S\tP50 MS\tP99 MS\tMAX MS\tVS GOCHANNEL")
	for _, r := range results {
		ratio := "-"
		if v := vsBase(r); v != 0 && r.mode == "throughput" {
			ratio = fmt.Sprintf("%.2fx rate", v)
		} else if v != 0 {
			ratio = fmt.Sprintf("%.2fx p50", v)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%.0f\t%.1f\t%.1f\t%.1f\t%s\n", r.kind, r.broker, r.mode, r.n, r.rate, r.p50, r.p99, r.max, ratio)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if keep {
		for _, r := range results {
			fmt.Fprintf(out, "%s %s kept in schema %s\n", r.kind, r.mode, r.schema)
		}
	}
	fmt.Fprintln(out, "(3 steps, 4 transactions per saga: start + 3 replies; for scale, dtm: 575 global transactions/s on 4 cores)")
	return nil
}

// sagaBenchRow is one --json row.
type sagaBenchRow struct {
	Bench string `json:"bench"`
	Kind  string `json:"kind"` // transport kind, as in bench transport
	// Broker is benchBroker.Label: "kfake", "kafka 127.0.0.1:9092", ...
	Broker string  `json:"broker"`
	Run    string  `json:"run"` // throughput or latency
	Sagas  int     `json:"sagas"`
	Rate   float64 `json:"sagas_per_s"`
	P50    float64 `json:"p50_ms"`
	P99    float64 `json:"p99_ms"`
	Max    float64 `json:"max_ms"`
	// VsGoChannel is Rate (throughput) or P50 (latency) over gochannel's in
	// the same run; absent without a gochannel run.
	VsGoChannel float64 `json:"vs_gochannel,omitempty"`
	Schema      string  `json:"schema,omitempty"` // with --keep-schema
}

type benchOrder struct {
	ID string `json:"id"`
}

// benchSagaKind runs n sagas on one transport kind; rate > 0 paces the
// starts at that many per second.
func benchSagaKind(ctx context.Context, admin *sql.DB, baseURL string, brokers benchBrokers, kind transport.Kind, n, starters int, rate float64, keep bool) (sagaBenchResult, error) {
	res := sagaBenchResult{kind: string(kind), n: n}
	schema, schemaURL, drop, err := scratchSchema(ctx, admin, baseURL, "mw_bench_saga")
	if err != nil {
		return res, err
	}
	res.schema = schema
	if !keep {
		defer drop()
	}
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return res, err
	}
	defer db.Close()
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	if _, err := migrate.Up(ctx, db, outbox.Migrations(), idempotency.Migrations(), saga.Migrations()); err != nil {
		return res, err
	}

	// A fresh fake per run; on a real broker, topics of this run only, so
	// that what an earlier run left unconsumed (same saga ids) stays there.
	br, err := brokers.open(kind)
	if err != nil {
		return res, err
	}
	defer br.Close()
	res.broker = br.Label
	tr, err := transport.Open(ctx, br.Config)
	if err != nil {
		return res, err
	}
	defer tr.Close()

	run := strings.TrimPrefix(schema, "mw_bench_saga_")
	topics := []string{"bench_inventory_" + run, "bench_payment_" + run, "bench_shipping_" + run}
	replies := "bench_orders_" + run + "_replies"
	defer br.dropTopics(context.WithoutCancel(ctx), append(topics, replies)...)
	step := func(name, topic string) saga.Step[benchOrder] {
		return saga.Step[benchOrder]{
			Name: name,
			Command: func(o benchOrder) (saga.Command, error) {
				return saga.Command{Topic: topic, Type: name + ".v1", Payload: o}, nil
			},
			Compensation: func(o benchOrder) (saga.Command, error) {
				return saga.Command{Topic: topic, Type: name + ".undo.v1", Payload: o}, nil
			},
		}
	}
	def, err := saga.Define("bench_orders", step("reserve", topics[0]), step("charge", topics[1]), step("ship", topics[2]))
	if err != nil {
		return res, err
	}
	reg := prometheus.NewRegistry()
	orch, err := saga.NewOrchestrator(db, def, saga.Config{ReplyTopic: replies, Registerer: reg})
	if err != nil {
		return res, err
	}
	store, err := idempotency.NewPostgresStore(db)
	if err != nil {
		return res, err
	}
	dedup, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "bench-orders-saga", Registerer: reg})
	if err != nil {
		return res, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	if err != nil {
		return res, err
	}
	pub := tr.Publisher()
	subscribe := func(topic, group string) (message.Subscriber, error) {
		sub, err := tr.Subscriber(group)
		if err != nil {
			return nil, err
		}
		if init, ok := sub.(message.SubscribeInitializer); ok {
			if err := init.SubscribeInitialize(topic); err != nil {
				return nil, fmt.Errorf("initialising topic %s: %w", topic, err)
			}
		}
		return sub, nil
	}
	for _, topic := range topics {
		sub, err := subscribe(topic, "bench_participant")
		if err != nil {
			return res, err
		}
		router.AddConsumerHandler("participant_"+topic, topic, sub, func(cmd *message.Message) error {
			typ := cmd.Metadata.Get(metadata.SagaStep) + ".succeeded"
			if cmd.Metadata.Get(metadata.SagaPhase) == saga.PhaseCompensation {
				typ = cmd.Metadata.Get(metadata.SagaStep) + ".compensated"
			}
			reply, err := saga.NewReply(cmd, typ, nil)
			if err != nil {
				return err
			}
			return pub.Publish(saga.ReplyTopic(cmd), reply)
		})
	}
	sub, err := subscribe(orch.ReplyTopic(), "bench_orchestrator")
	if err != nil {
		return res, err
	}
	router.AddConsumerHandler("orchestrator", orch.ReplyTopic(), sub, orch.HandleReply).AddMiddleware(dedup.Middleware)

	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	relay, err := outbox.NewRelay(db, pub, outbox.RelayConfig{ListenURL: schemaURL, PollInterval: 100 * time.Millisecond})
	if err != nil {
		return res, err
	}
	wg.Add(3)
	go func() { defer wg.Done(); _ = router.Run(rctx) }()
	go func() { defer wg.Done(); _ = relay.Run(rctx) }()
	go func() { defer wg.Done(); _ = orch.Run(rctx) }()
	defer orch.Close()
	defer relay.Close()
	defer router.Close()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return res, ctx.Err()
	}

	begin := time.Now()
	var next atomic.Int64
	errc := make(chan error, starters)
	var sw sync.WaitGroup
	for range starters {
		sw.Add(1)
		go func() {
			defer sw.Done()
			for {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				if rate > 0 {
					at := begin.Add(time.Duration(float64(i-1) / rate * float64(time.Second)))
					select {
					case <-time.After(time.Until(at)):
					case <-ctx.Done():
						errc <- ctx.Err()
						return
					}
				}
				id := fmt.Sprintf("bench-%07d", i)
				tx, err := db.BeginTx(ctx, nil)
				if err == nil {
					err = orch.Start(ctx, tx, id, benchOrder{ID: id})
					if err == nil {
						err = tx.Commit()
					} else {
						_ = tx.Rollback()
					}
				}
				if err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	sw.Wait()
	close(errc)
	if err := <-errc; err != nil {
		return res, err
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var done int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_saga_instances WHERE state = 'completed'`).Scan(&done); err != nil {
			return res, fmt.Errorf("counting completed sagas: %w", err)
		}
		if done == n {
			break
		}
		select {
		case <-ctx.Done():
			return res, fmt.Errorf("%d of %d sagas completed before the timeout: %w", done, n, ctx.Err())
		case <-tick.C:
		}
	}
	var last time.Time
	err = db.QueryRowContext(ctx, `WITH d AS (
			SELECT EXTRACT(EPOCH FROM (s.at - i.created_at)) * 1000 AS ms, s.at
			FROM millwright_saga_instances i JOIN millwright_saga_steps s ON s.saga_id = i.id AND s.kind = 'completed')
		SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms), max(at) FROM d`).
		Scan(&res.p50, &res.p99, &res.max, &last)
	if err != nil {
		return res, fmt.Errorf("reading durations: %w", err)
	}
	res.elapsed = last.Sub(begin)
	res.rate = float64(n) / res.elapsed.Seconds()
	return res, nil
}
