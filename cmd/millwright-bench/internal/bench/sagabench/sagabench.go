// Package sagabench is `millwright-bench saga`: completed three-step
// sagas per second and the duration of one saga, on each transport kind,
// beside the ceiling the database allows and the time of each hop of a
// step.
//
// Each run works in a scratch schema of its own, on topics named after it.
// Participants are in-process handlers that answer at once (they touch no
// database); commands go through the outbox relay, replies through the
// transport, and the orchestrator consumes them behind the idempotency
// middleware, as a service would.
package sagabench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/roundtrips"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // the bench runs any kind its flags name
)

// Broker is the broker one kind runs against, chosen by the caller (the
// CLI's broker flags).
type Broker struct {
	// Config reaches the broker.
	Config transport.Config
	// Label names the broker in the rows ("kfake", "kafka HOST:PORT", ...).
	Label string
	// Close stops an in-process broker. Nil for none.
	Close func()
	// Cleanup deletes, best effort, what a run created on a real broker
	// (topics; on RabbitMQ the groups' queues). Nil for none.
	Cleanup func(ctx context.Context, topics, groups []string)
}

// Config configures Run.
type Config struct {
	// Admin is a pool on the server the runs use: scratch schemas are
	// made through it and the ceiling is measured on it. Required.
	Admin *sql.DB
	// Scratch creates a scratch schema named prefix_<random> and returns
	// it, a URL whose search_path points at it, and a function dropping
	// it. Required.
	Scratch func(ctx context.Context, prefix string) (schema, schemaURL string, drop func(), err error)
	// OpenBroker returns the broker of a kind other than sql (whose
	// "broker" is the scratch schema itself). Required unless Kinds is
	// only sql.
	OpenBroker func(kind transport.Kind) (Broker, error)
	// PostgresLabel names the Postgres server in the sql kind's rows.
	PostgresLabel string
	// Kinds to run, in order.
	Kinds []transport.Kind
	// Drivers the orchestrator, its idempotency store, the starters and
	// the relays run on, each kind's runs on every one in turn: "pq"
	// (lib/pq through pgconn.Open, as postgres.Open) and "pgx" (pgxpool).
	// Default both.
	Drivers []string
	// Sagas in the throughput run. Default 2000.
	Sagas int
	// Starters are the goroutines starting sagas, each in its own
	// transaction. Default 16.
	Starters int
	// LatencySagas in the latency run (0: none). LatencyRate is its start
	// rate, sagas/s, below capacity. Default 0 and 20.
	LatencySagas int
	LatencyRate  float64
	// Consumers is the number of subscribers, in one consumer group, on
	// each command topic and on the reply topic, on amqp, whose
	// subscribers handle one message at a time and compete for a group's
	// queue; elsewhere 1 (Kafka's subscriber handles its partitions
	// concurrently, gochannel's subscribers each get every message, and
	// watermill-sql's take turns). Default 1.
	Consumers int
	// Relays is the number of outbox relays. Default 1.
	Relays int
	// SQLReplyShards is the orchestrator's saga.Config.ReplyShards on sql,
	// whose consumer group applies a topic's replies one at a time; other
	// kinds use one reply topic. Default 4.
	SQLReplyShards int
	// KafkaKeyParallelism is transport/kafka's Config.KeyParallelism of
	// every Kafka consumer of the run (the participants' and the
	// orchestrator's): messages of different sagas in one partition are
	// handled at once, each saga's in order (commands and replies are
	// keyed by saga id). 0: one message per partition at a time
	// (Watermill's subscriber), which queues each partition's replies
	// behind the orchestrator's transaction. Default 0.
	KafkaKeyParallelism int
	// Rounds is how many times every run is repeated, the kinds taking
	// turns within a round so that the machine's drift falls on all of
	// them; a run's row is its median round (by rate for throughput, by
	// p99 for latency), with that round's hops. Default 1.
	Rounds int
	// RelayPublishConcurrency is the relays' relay.Config.PublishConcurrency
	// (concurrent Publish calls of a batch, for publishers without
	// PublishBatch). Default 0: the relay's default.
	RelayPublishConcurrency int
	// CeilingFor is how long the database's commit rate is measured (0: not
	// measured).
	CeilingFor time.Duration
	// Timeout bounds each run. Default 5m.
	Timeout time.Duration
	// KeepSchema keeps each run's scratch schema (its name is in the row).
	KeepSchema bool
	// Progress receives a line per run. Default io.Discard.
	Progress io.Writer
	// Step, if set, is called after each run (and after the ceiling) with
	// the runs done and the runs in all. Default nil.
	Step func(done, total int)
	// Shapes of saga to run (ShapeLinear, ShapeParallel, ShapeVersions),
	// each kind's runs in every one in turn. Default ShapeLinear.
	Shapes []string
}

// Shapes of the bench's saga: the same three steps (reserve, charge,
// ship), each answered at once by its participant.
const (
	// ShapeLinear runs reserve, then charge, then ship.
	ShapeLinear = "linear"
	// ShapeParallel runs reserve and charge at once (a two-branch
	// saga.Step Parallel group), then ship.
	ShapeParallel = "parallel"
	// ShapeVersions is ShapeLinear with a second version of the saga type
	// (the parallel one) registered beside it in saga.Config.Versions: what
	// running two versions side by side costs the version that runs.
	ShapeVersions = "versions"
)

func (c *Config) setDefaults() {
	if c.Sagas == 0 {
		c.Sagas = 2000
	}
	if c.Starters == 0 {
		c.Starters = 16
	}
	if c.LatencyRate == 0 {
		c.LatencyRate = 20
	}
	if c.Consumers == 0 {
		c.Consumers = 1
	}
	if c.Relays == 0 {
		c.Relays = 1
	}
	if c.SQLReplyShards == 0 {
		c.SQLReplyShards = 4
	}
	if c.Rounds == 0 {
		c.Rounds = 1
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	if len(c.Drivers) == 0 {
		c.Drivers = []string{DriverPQ, DriverPgx}
	}
	if len(c.Shapes) == 0 {
		c.Shapes = []string{ShapeLinear}
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if c.Admin == nil || c.Scratch == nil {
		errs = append(errs, errors.New("bench saga: Config.Admin and Config.Scratch are required"))
	}
	for _, d := range c.Drivers {
		if d != DriverPQ && d != DriverPgx {
			errs = append(errs, fmt.Errorf("bench saga: driver %q: want pq or pgx", d))
		}
	}
	if c.SQLReplyShards < 0 || c.SQLReplyShards > 64 {
		errs = append(errs, fmt.Errorf("bench saga: --sql-reply-shards %d: want 1..64", c.SQLReplyShards))
	}
	if c.Sagas < 1 || c.Starters < 1 || c.Consumers < 1 || c.Relays < 1 || c.Rounds < 1 {
		errs = append(errs, fmt.Errorf("bench saga: --sagas %d, --starters %d, --consumers %d, --relays %d and --rounds %d must be at least 1",
			c.Sagas, c.Starters, c.Consumers, c.Relays, c.Rounds))
	}
	if c.LatencySagas < 0 || c.LatencyRate <= 0 {
		errs = append(errs, fmt.Errorf("bench saga: --latency-sagas %d must be at least 0 and --latency-rate %g above 0", c.LatencySagas, c.LatencyRate))
	}
	if len(c.Kinds) == 0 {
		errs = append(errs, errors.New("bench saga: no kinds to run"))
	}
	for _, sh := range c.Shapes {
		if sh != ShapeLinear && sh != ShapeParallel && sh != ShapeVersions {
			errs = append(errs, fmt.Errorf("bench saga: --shapes %q: want %s, %s or %s", sh, ShapeLinear, ShapeParallel, ShapeVersions))
		}
	}
	for _, k := range c.Kinds {
		if k != transport.SQL && c.OpenBroker == nil {
			errs = append(errs, fmt.Errorf("bench saga: kind %s needs Config.OpenBroker", k))
			break
		}
	}
	return errors.Join(errs...)
}

// Row kinds.
const (
	RowRun     = "run"     // one run of one kind
	RowHop     = "hop"     // one hop of a step, in one run
	RowCeiling = "ceiling" // the database's commit rate
)

// Row is one line of the report, and one --json object.
type Row struct {
	Bench string `json:"bench"` // "saga"
	Row   string `json:"row"`   // RowRun, RowHop or RowCeiling
	Kind  string `json:"kind,omitempty"`
	// Driver is the Postgres driver of the run ("pq" or "pgx").
	Driver string `json:"driver,omitempty"`
	// Shape is the saga's shape (ShapeLinear, ShapeParallel,
	// ShapeVersions).
	Shape string `json:"shape,omitempty"`
	// VsLinear is, for a run of another shape, its Rate (throughput) or
	// P50 (latency) over the linear run's of the same kind, driver and
	// run in the same Run.
	VsLinear float64 `json:"vs_linear,omitempty"`
	// RoundTrips is the round trips one measured saga cost the
	// orchestrator, its idempotency store and its starter together (not
	// the relay): their pool's connections go through a counting proxy
	// (cmd/millwright-bench/internal/bench/roundtrips) in every run, on both drivers alike.
	RoundTrips float64 `json:"round_trips_per_saga,omitempty"`
	// Broker names the broker: "kfake", "kafka 127.0.0.1:9092", ...
	Broker string `json:"broker,omitempty"`
	Run    string `json:"run,omitempty"` // throughput or latency
	Sagas  int    `json:"sagas,omitempty"`
	// Rate is completed sagas/s: sagas / (first start .. last completion).
	Rate float64 `json:"sagas_per_s,omitempty"`
	// P50, P99 and Max are saga durations (start to completion), or a
	// hop's times, in milliseconds.
	P50 float64 `json:"p50_ms,omitempty"`
	P99 float64 `json:"p99_ms,omitempty"`
	Max float64 `json:"max_ms,omitempty"`
	// P99OverP50 is P99 / P50.
	P99OverP50 float64 `json:"p99_over_p50,omitempty"`
	// VsGoChannel is Rate (throughput) or P50 (latency) over gochannel's
	// in the same Run; absent without a gochannel run.
	VsGoChannel float64 `json:"vs_gochannel,omitempty"`
	// VsPQ is, for a pgx run, its Rate (throughput) over the pq run's of
	// the same kind in the same Run, or the pq run's P50 over its own
	// (latency): above 1 is pgx faster.
	VsPQ float64 `json:"vs_pq,omitempty"`
	// TxPerSaga is the committed write transactions one saga cost in the
	// run, all parties (see Report.Footer), and OfCeiling the run's Rate
	// over the ceiling those allow (throughput runs).
	TxPerSaga float64 `json:"tx_per_saga,omitempty"`
	OfCeiling float64 `json:"of_ceiling,omitempty"`
	// RelayBatches is how many batches the relay marked (rows per batch =
	// 3 x sagas / RelayBatches).
	RelayBatches int    `json:"relay_batches,omitempty"`
	Schema       string `json:"schema,omitempty"` // with KeepSchema
	// Rounds is Config.Rounds, and RoundRates and RoundP99s every
	// round's Rate and P99 in the order they ran (a run's row is the
	// median round's).
	Rounds     int       `json:"rounds,omitempty"`
	RoundRates []float64 `json:"round_sagas_per_s,omitempty"`
	RoundP99s  []float64 `json:"round_p99_ms,omitempty"`
	// Hop names the hop of a RowHop (see Hops), or the relay's timed part
	// of the first hop ("relay: claim statement", "relay: publish call",
	// "relay: mark statement"), then with Calls.
	Hop   string `json:"hop,omitempty"`
	Calls int    `json:"calls,omitempty"`
	// Writers and CommitsPerS are the ceiling's measurement: single-row
	// transactions committed per second by that many sessions.
	Writers     int     `json:"writers,omitempty"`
	CommitsPerS float64 `json:"commits_per_s,omitempty"`
}

// Hops of a step, in the order a step takes them.
var Hops = []string{
	// From the orchestrator writing the command (its history row, in the
	// transaction of the start or of the previous reply) to that
	// transaction's commit.
	"command: written -> committed",
	// From that commit to the participant receiving the command: the
	// relay's wake-up (NOTIFY or poll), claim and publish, and the
	// transport's delivery.
	"command: committed -> participant",
	// From the participant receiving the command to the orchestrator's
	// reply handler starting: the participant's publish of the reply and
	// the transport's delivery.
	"reply: participant -> orchestrator",
	// The reply handler: the idempotency middleware's transaction with
	// the transition (and the next command) in it, commit included.
	"orchestrator transaction",
	// Kafka only, the command hop split at the message's producer
	// timestamp (set by Sarama as the relay hands it over): commit ->
	// handed to the producer (the relay's wake-up, claim, the batch
	// before it), and -> the participant (produce request, broker, the
	// consumer's fetch and its partition's queue).
	"command: committed -> produced",
	"command: produced -> participant",
}

// Report is what Run measured.
type Report struct {
	Rows []Row
}

// Run runs the benchmark: per kind a throughput run and, with
// LatencySagas, a latency run, Rounds times (see Config.Rounds); then,
// with CeilingFor, the database's commit rate with Starters writers. When
// a run fails, the report holds every round run before it.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	type plan struct {
		mode string
		n    int
		rate float64
	}
	plans := []plan{{"throughput", cfg.Sagas, 0}}
	if cfg.LatencySagas > 0 {
		plans = append(plans, plan{"latency", cfg.LatencySagas, cfg.LatencyRate})
	}
	// Topics are deleted when every run is done: a Kafka broker removes a
	// deleted topic's files a minute later (file.delete.delay.ms), in the
	// middle of a later run, and the latency figures would time that.
	var cleanups []func()
	atEnd := func(f func()) { cleanups = append(cleanups, f) }
	defer func() {
		for _, f := range cleanups {
			f()
		}
	}()
	results := make([][]roundResult, len(cfg.Kinds)*len(plans)*len(cfg.Drivers)*len(cfg.Shapes))
	step := func() {}
	if cfg.Step != nil {
		done, total := 0, cfg.Rounds*len(cfg.Kinds)*len(plans)*len(cfg.Drivers)*len(cfg.Shapes)
		if cfg.CeilingFor > 0 {
			total++
		}
		step = func() { done++; cfg.Step(done, total) }
	}
	for round := range cfg.Rounds {
		for ki, kind := range cfg.Kinds {
			for pi, p := range plans {
				for di, driver := range cfg.Drivers {
					for si, shape := range cfg.Shapes {
						fmt.Fprintf(cfg.Progress, "%s %s on %s, %s saga: %d sagas (round %d of %d) ...\n", kind, p.mode, driver, shape, p.n, round+1, cfg.Rounds)
						rctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
						r, h, err := runKind(rctx, cfg, kind, driver, shape, p.n, p.rate, atEnd)
						cancel()
						if err != nil {
							// The runs so far are reported with the error.
							return Report{Rows: runsSoFar(results)}, fmt.Errorf("bench saga %s %s on %s, %s saga (round %d): %w", kind, p.mode, driver, shape, round+1, err)
						}
						r.Run = p.mode
						for i := range h {
							h[i].Run, h[i].Driver, h[i].Shape = p.mode, driver, shape
						}
						i := ((ki*len(plans)+pi)*len(cfg.Drivers)+di)*len(cfg.Shapes) + si
						results[i] = append(results[i], roundResult{run: r, hops: h})
						step()
					}
				}
			}
		}
	}
	runs, hops := medianRuns(results, cfg.Rounds)
	var ceiling *Row
	if cfg.CeilingFor > 0 {
		fmt.Fprintf(cfg.Progress, "ceiling: single-row commits with %d writers for %s ...\n", cfg.Starters, cfg.CeilingFor)
		c, err := MeasureCommits(ctx, cfg.Admin, cfg.Scratch, cfg.Starters, cfg.CeilingFor)
		if err != nil {
			return Report{}, fmt.Errorf("bench saga: ceiling: %w", err)
		}
		ceiling = &Row{Bench: "saga", Row: RowCeiling, Writers: cfg.Starters, CommitsPerS: c}
		step()
	}
	compareRuns(runs, ceiling)
	rep := Report{Rows: append(runs, hops...)}
	if ceiling != nil {
		rep.Rows = append(rep.Rows, *ceiling)
	}
	return rep, nil
}

// runsSoFar is every round's run row in results.
func runsSoFar(results [][]roundResult) []Row {
	var done []Row
	for _, rs := range results {
		for _, r := range rs {
			done = append(done, r.run)
		}
	}
	return done
}

// medianRuns is each run's median round (its row, with every round's
// rate and p99, and that round's hops).
func medianRuns(results [][]roundResult, rounds int) (runs, hops []Row) {
	for _, rs := range results {
		m := medianRound(rs)
		run := rs[m].run
		run.Rounds = rounds
		for _, r := range rs {
			run.RoundRates = append(run.RoundRates, r.run.Rate)
			run.RoundP99s = append(run.RoundP99s, r.run.P99)
		}
		runs = append(runs, run)
		hops = append(hops, rs[m].hops...)
	}
	return runs, hops
}

// compareRuns sets each run's same-run ratios: against the same kind and
// run on pq (VsPQ), against gochannel on the same driver (VsGoChannel),
// and the throughput's share of the database's ceiling (OfCeiling, when
// measured).
func compareRuns(runs []Row, ceiling *Row) {
	base, pq, linear := map[string]Row{}, map[string]Row{}, map[string]Row{}
	for _, r := range runs {
		if r.Kind == string(transport.GoChannel) {
			base[r.Run+"\x00"+r.Driver+"\x00"+r.Shape] = r
		}
		if r.Driver == DriverPQ {
			pq[r.Kind+"\x00"+r.Run+"\x00"+r.Shape] = r
		}
		if r.Shape == ShapeLinear {
			linear[r.Kind+"\x00"+r.Run+"\x00"+r.Driver] = r
		}
	}
	for i, r := range runs {
		if l, ok := linear[r.Kind+"\x00"+r.Run+"\x00"+r.Driver]; ok && r.Shape != ShapeLinear {
			if r.Run == "throughput" && l.Rate > 0 {
				runs[i].VsLinear = r.Rate / l.Rate
			} else if r.Run == "latency" && l.P50 > 0 {
				runs[i].VsLinear = r.P50 / l.P50
			}
		}
		if p, ok := pq[r.Kind+"\x00"+r.Run+"\x00"+r.Shape]; ok && r.Driver != DriverPQ {
			if r.Run == "throughput" && p.Rate > 0 {
				runs[i].VsPQ = r.Rate / p.Rate
			} else if r.Run == "latency" && r.P50 > 0 {
				runs[i].VsPQ = p.P50 / r.P50
			}
		}
		if b, ok := base[r.Run+"\x00"+r.Driver+"\x00"+r.Shape]; ok {
			if r.Run == "throughput" && b.Rate > 0 {
				runs[i].VsGoChannel = r.Rate / b.Rate
			} else if r.Run == "latency" && b.P50 > 0 {
				runs[i].VsGoChannel = r.P50 / b.P50
			}
		}
		if ceiling != nil && r.Run == "throughput" && r.TxPerSaga > 0 {
			runs[i].OfCeiling = r.Rate / (ceiling.CommitsPerS / r.TxPerSaga)
		}
	}
}

// roundResult is one round of one run: its row and its hops.
type roundResult struct {
	run  Row
	hops []Row
}

// medianRound returns the index of the median of rounds, by rate for a
// throughput run and by p99 for a latency run; of the middle two of an
// even count, the worse (the lower rate, the higher p99).
func medianRound(rounds []roundResult) int {
	idx := make([]int, len(rounds))
	for i := range idx {
		idx[i] = i
	}
	key := func(i int) float64 {
		if rounds[i].run.Run == "latency" {
			return -rounds[i].run.P99 // ascending from the worst
		}
		return rounds[i].run.Rate
	}
	sort.SliceStable(idx, func(a, b int) bool { return key(idx[a]) < key(idx[b]) })
	return idx[(len(idx)-1)/2]
}

type benchOrder struct {
	ID string `json:"id"`
}

// hopClock records, per saga step, when the participant received the
// command and when the orchestrator's reply handler started and ended.
type hopClock struct {
	mu sync.Mutex
	// committed is when the transaction that wrote a step's command
	// committed (the start's, or the previous step's reply handler's).
	committed, received, started, done map[string]time.Time
	// produced is the Kafka producer timestamp of a step's command.
	produced map[string]time.Time
}

func newHopClock() *hopClock {
	return &hopClock{committed: map[string]time.Time{}, received: map[string]time.Time{}, started: map[string]time.Time{}, done: map[string]time.Time{},
		produced: map[string]time.Time{}}
}

func stepKey(msg *message.Message) string {
	return msg.Metadata.Get(metadata.SagaID) + "\x00" + msg.Metadata.Get(metadata.SagaStep)
}

// first records t under k in m unless a time is there (a redelivery).
func (c *hopClock) first(m map[string]time.Time, k string, t time.Time) {
	c.mu.Lock()
	if _, ok := m[k]; !ok {
		m[k] = t
	}
	c.mu.Unlock()
}

// latest records t under k in m unless a later time is there.
func (c *hopClock) latest(m map[string]time.Time, k string, t time.Time) {
	c.mu.Lock()
	if old, ok := m[k]; !ok || t.After(old) {
		m[k] = t
	}
	c.mu.Unlock()
}

// shapeOf is the bench saga of shape, from its three steps: the
// orchestrator's definition and Config (Versions), the steps whose
// commands the start writes, and the step whose command each step's
// success writes (for the hop clock).
func shapeOf(shape string, reserve, charge, ship saga.Step[benchOrder]) (def *saga.Definition[benchOrder], cfg saga.Config, firsts []string, next map[string]string, err error) {
	linear := func(version int) (*saga.Definition[benchOrder], error) {
		return saga.DefineVersion("bench_orders", version, reserve, charge, ship)
	}
	parallel := func(version int) (*saga.Definition[benchOrder], error) {
		return saga.DefineVersion("bench_orders", version,
			saga.Step[benchOrder]{Name: "prepare", Parallel: []saga.Step[benchOrder]{reserve, charge}}, ship)
	}
	switch shape {
	case ShapeParallel:
		def, err = parallel(1)
		return def, cfg, []string{"reserve", "charge"}, map[string]string{"reserve": "ship", "charge": "ship"}, err
	case ShapeVersions:
		// The running version is the newer one, so that Start uses it
		// (an orchestrator starts its own definition's version); the
		// other is registered beside it, as after a deploy that keeps the
		// previous version's instances running.
		var other *saga.Definition[benchOrder]
		if other, err = parallel(1); err != nil {
			return nil, cfg, nil, nil, err
		}
		cfg.Versions = []saga.Versioned{other}
		def, err = linear(2)
	default:
		def, err = linear(1)
	}
	return def, cfg, []string{"reserve"}, map[string]string{"reserve": "charge", "charge": "ship"}, err
}

// kafkaPartitions is the partition count of the topics a Kafka run
// creates (transport/kafka's default is 8).
const kafkaPartitions = 32

// amqpChannels is the RabbitMQ publisher's channel pool in the bench
// (transport/amqp's default is 8).
const amqpChannels = 32

// participant is the bench's participant: it answers every command at
// once with a success (or compensated) reply, published on pub, and
// records when the command arrived.
func (c *hopClock) participant(pub message.Publisher) message.NoPublishHandlerFunc {
	return func(cmd *message.Message) error {
		c.first(c.received, stepKey(cmd), time.Now())
		if ts, ok := wkafka.MessageTimestampFromCtx(cmd.Context()); ok && !ts.IsZero() {
			c.first(c.produced, stepKey(cmd), ts)
		}
		typ := cmd.Metadata.Get(metadata.SagaStep) + ".succeeded"
		if cmd.Metadata.Get(metadata.SagaPhase) == saga.PhaseCompensation {
			typ = cmd.Metadata.Get(metadata.SagaStep) + ".compensated"
		}
		reply, err := saga.NewReply(cmd, typ, nil)
		if err != nil {
			return err
		}
		return pub.Publish(saga.ReplyTopic(cmd), reply)
	}
}

// timed is the orchestrator's outermost middleware: it records when the
// reply handler started and ended, and so when the next step's command
// (written in that transaction, nextStep of the reply's step) committed.
func (c *hopClock) timed(nextStep map[string]string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			k := stepKey(msg)
			c.first(c.started, k, time.Now())
			out, err := h(msg)
			if err == nil {
				now := time.Now()
				c.first(c.done, k, now)
				if next := nextStep[msg.Metadata.Get(metadata.SagaStep)]; next != "" {
					// The latest: after a group, the next step's command
					// is written by the reply that completes the group.
					c.latest(c.committed, msg.Metadata.Get(metadata.SagaID)+"\x00"+next, now)
				}
			}
			return out, err
		}
	}
}

// warmupSagas run to completion before a run's clock starts: consumer
// groups join, connections open and plans are cached outside the figures
// (on Kafka the first group join alone takes a second or more).
const warmupSagas = 10

// brokerFor returns the broker of kind for a run on db, tuned for the
// bench, and the subscribers per topic and group its consumers run.
func brokerFor(cfg Config, kind transport.Kind, db *sql.DB) (Broker, int, error) {
	if kind == transport.SQL {
		var br Broker
		br.Config = transport.Config{Kind: transport.SQL}
		br.Config.SQL.DB = db
		// watermill-sql's subscriber polls; at its default 100 ms the
		// figures would show that poll. 10 ms, as bench outbox uses.
		br.Config.SQL.PollInterval = 10 * time.Millisecond
		br.Config.SQL.HorizonCheckInterval = -1
		br.Label = cfg.PostgresLabel
		// One subscriber per group: watermill-sql's subscribers of one
		// group take turns on the group's offset row (FOR UPDATE, held
		// while a fetched batch is handled), so more add no concurrency,
		// and each waits holding a connection of the pool the handlers
		// need.
		return br, 1, nil
	}
	br, err := cfg.OpenBroker(kind)
	if err != nil {
		return br, 0, err
	}
	consumers := 1
	if kind == transport.Kafka && br.Config.Kafka.Partitions == 0 {
		// Watermill's Kafka subscriber handles a partition's messages
		// one at a time: partitions are the reply handler's concurrency.
		br.Config.Kafka.Partitions = kafkaPartitions
	}
	if kind == transport.Kafka && cfg.KafkaKeyParallelism > 0 {
		br.Config.Kafka.KeyParallelism = cfg.KafkaKeyParallelism
		br.Label += fmt.Sprintf(", %d keys at once per partition", cfg.KafkaKeyParallelism)
	}
	if kind == transport.AMQP {
		consumers = cfg.Consumers
		// Publishes wait for their confirm on a channel of the pool: the
		// relay's (PublishConcurrency at a time) and every participant's
		// reply share it.
		if br.Config.AMQP.ChannelPoolSize == 0 {
			br.Config.AMQP.ChannelPoolSize = amqpChannels
		}
	}
	return br, consumers, nil
}

// runKind runs n sagas on one kind; rate > 0 paces the starts. It hands
// the deletion of the run's topics to atEnd, which Run calls when every
// run is done.
func runKind(ctx context.Context, cfg Config, kind transport.Kind, driver, shape string, n int, rate float64, atEnd func(func())) (Row, []Row, error) {
	res := Row{Bench: "saga", Row: RowRun, Kind: string(kind), Driver: driver, Shape: shape, Sagas: n}
	schema, schemaURL, drop, err := cfg.Scratch(ctx, "mw_bench_saga")
	if err != nil {
		return res, nil, err
	}
	if cfg.KeepSchema {
		res.Schema = schema
	} else {
		defer drop()
	}
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return res, nil, err
	}
	defer db.Close()
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	if _, err := migrate.Up(ctx, postgres.From(db), outbox.Migrations(), idempotency.Migrations(), saga.Migrations()); err != nil {
		return res, nil, err
	}

	run := strings.TrimPrefix(schema, "mw_bench_saga_")
	topics := []string{"bench_inventory_" + run, "bench_payment_" + run, "bench_shipping_" + run}
	replies := "bench_orders_" + run + "_replies"
	const participantGroup, orchestratorGroup = "bench_participant", "bench_orchestrator"
	br, consumers, err := brokerFor(cfg, kind, db)
	if err != nil {
		return res, nil, err
	}
	if br.Close != nil {
		defer br.Close()
	}
	shards := 1
	if kind == transport.SQL {
		shards = cfg.SQLReplyShards
	}
	res.Broker = br.Label
	if shards > 1 {
		res.Broker += fmt.Sprintf(", %d reply topics", shards)
	}
	tcfg := br.Config
	tcfg.WaitForBroker = transport.NoWait // a benchmark fails at once on a broker that is down
	tr, err := transport.Open(ctx, tcfg)
	if err != nil {
		return res, nil, err
	}
	defer tr.Close()

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
	def, scfg, firsts, nextStep, err := shapeOf(shape, step("reserve", topics[0]), step("charge", topics[1]), step("ship", topics[2]))
	if err != nil {
		return res, nil, err
	}
	reg := prometheus.NewRegistry()
	counter, countedURL, err := roundtrips.Start(schemaURL)
	if err != nil {
		return res, nil, err
	}
	defer counter.Close()
	scfg.ReplyTopic, scfg.ReplyShards, scfg.Registerer = replies, shards, reg
	ps, err := openParties(ctx, driver, countedURL, def, scfg)
	if err != nil {
		return res, nil, err
	}
	defer ps.close()
	orch, store := ps.orch, ps.store
	if br.Cleanup != nil {
		// Before any topic exists: the subscribers below create them.
		all := append(slices.Clone(topics), orch.ReplyTopics()...)
		atEnd(func() {
			br.Cleanup(context.WithoutCancel(ctx), all, []string{participantGroup, orchestratorGroup})
		})
	}
	dedup, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "bench-orders-saga", Registerer: reg})
	if err != nil {
		return res, nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	if err != nil {
		return res, nil, err
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
	clock := newHopClock()
	participant := clock.participant(pub)
	timed := clock.timed(nextStep)
	for c := range consumers {
		for _, topic := range topics {
			sub, err := subscribe(topic, participantGroup)
			if err != nil {
				return res, nil, err
			}
			router.AddConsumerHandler(fmt.Sprintf("participant_%s_%d", topic, c), topic, sub, participant)
		}
		for i, topic := range orch.ReplyTopics() {
			sub, err := subscribe(topic, orchestratorGroup)
			if err != nil {
				return res, nil, err
			}
			// timed outermost: the hop includes the middleware's transaction.
			router.AddConsumerHandler(fmt.Sprintf("orchestrator_%d_%d", c, i), topic, sub, orch.HandleReply).
				AddMiddleware(timed, dedup.Middleware)
		}
	}

	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	// The relays get a pool and a publisher of their own that time their
	// claims, marks and publishes (the sql kind's publisher is left as it
	// is: the relay publishes in the database through it).
	rt := &relayTimes{}
	newRelay, closeRelays, err := openRelayPool(ctx, driver, schemaURL, rt)
	if err != nil {
		return res, nil, err
	}
	defer closeRelays()
	relayPub := pub
	if kind == transport.Kafka {
		// The relay gets a producer of its own, as in a service whose
		// participants run elsewhere: Sarama's producer sends one request
		// at a time per broker (Net.MaxOpenRequests 1, for order under
		// retries), and a shared one would queue the relay's publishes
		// behind every participant's reply.
		rtr, err := transport.Open(ctx, tcfg)
		if err != nil {
			return res, nil, err
		}
		defer rtr.Close()
		relayPub = rtr.Publisher()
	}
	if kind != transport.SQL && driver == DriverPQ {
		relayPub = rt.timed(relayPub)
	}
	for range cfg.Relays {
		rel, err := newRelay(relayPub, relay.Config{ListenURL: schemaURL, PollInterval: 100 * time.Millisecond,
			PublishConcurrency: cfg.RelayPublishConcurrency})
		if err != nil {
			return res, nil, err
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = rel.Run(rctx) }()
		defer rel.Close()
	}
	wg.Add(2)
	go func() { defer wg.Done(); _ = router.Run(rctx) }()
	go func() { defer wg.Done(); _ = orch.Run(rctx) }()
	defer orch.Close()
	defer router.Close()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return res, nil, ctx.Err()
	}

	start := func(id string) error {
		if err := ps.start(ctx, id); err != nil {
			return err
		}
		now := time.Now()
		for _, s := range firsts {
			clock.first(clock.committed, id+"\x00"+s, now)
		}
		return nil
	}
	for i := range warmupSagas {
		if err := start(fmt.Sprintf("warmup-%02d", i)); err != nil {
			return res, nil, fmt.Errorf("warm-up: %w", err)
		}
	}
	if err := waitCompleted(ctx, db, "warmup-%", warmupSagas); err != nil {
		return res, nil, fmt.Errorf("warm-up: %w", err)
	}
	var batchesBefore int
	if err := db.QueryRowContext(ctx, `SELECT count(DISTINCT published_at) FROM millwright_outbox`).Scan(&batchesBefore); err != nil {
		return res, nil, err
	}
	rt.reset() // the warm-up's are not measured
	rtBefore := counter.Count()

	begin := time.Now()
	if err := startSagas(ctx, begin, n, cfg.Starters, rate, start); err != nil {
		return res, nil, err
	}
	if err := waitCompleted(ctx, db, "bench-%", n); err != nil {
		return res, nil, err
	}
	res.RoundTrips = float64(counter.Count()-rtBefore) / float64(n)
	if err := measure(ctx, db, &res, begin, batchesBefore); err != nil {
		return res, nil, err
	}
	hops, err := hopRows(ctx, db, clock, res)
	if err != nil {
		return res, nil, err
	}
	return res, append(hops, rt.rows(res)...), nil
}

// measure fills in res's figures from the run's tables: durations of the
// measured sagas, their rate from begin, and the relay's batches since
// batchesBefore.
func measure(ctx context.Context, db *sql.DB, res *Row, begin time.Time, batchesBefore int) error {
	var last time.Time
	err := db.QueryRowContext(ctx, `WITH d AS (
			SELECT EXTRACT(EPOCH FROM (s.at - i.created_at)) * 1000 AS ms, s.at
			FROM millwright_saga_instances i JOIN millwright_saga_steps s ON s.saga_id = i.id AND s.kind = 'completed'
			WHERE i.id LIKE 'bench-%')
		SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms), max(at) FROM d`).
		Scan(&res.P50, &res.P99, &res.Max, &last)
	if err != nil {
		return fmt.Errorf("reading durations: %w", err)
	}
	res.Rate = float64(res.Sagas) / last.Sub(begin).Seconds()
	if res.P50 > 0 {
		res.P99OverP50 = res.P99 / res.P50
	}
	var batches int
	if err := db.QueryRowContext(ctx, `SELECT count(DISTINCT published_at) FROM millwright_outbox`).Scan(&batches); err != nil {
		return err
	}
	res.RelayBatches = batches - batchesBefore
	res.TxPerSaga = txPerSaga(transport.Kind(res.Kind), res.Sagas, res.RelayBatches)
	return nil
}

// startSagas starts sagas bench-0000001 .. bench-n from starters
// goroutines through start; rate > 0 paces them from begin.
func startSagas(ctx context.Context, begin time.Time, n, starters int, rate float64, start func(id string) error) error {
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
					t := time.NewTimer(time.Until(at))
					select {
					case <-t.C:
					case <-ctx.Done():
						t.Stop()
						errc <- ctx.Err()
						return
					}
				}
				if err := start(fmt.Sprintf("bench-%07d", i)); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	sw.Wait()
	close(errc)
	return <-errc
}

// txPerSaga is the write transactions one saga commits, all parties: the
// orchestrator's 4 (the start and one per reply, each with its idempotency
// mark) and the relay's per batch (a claim and a mark; one in-database
// move on sql) shared by the batch's rows. On sql the transport adds the
// participants' 3 reply INSERTs (its consumers' offset updates, one per
// fetched batch of up to 100 messages, are left out). The participants
// here write nothing else.
func txPerSaga(kind transport.Kind, n, batches int) float64 {
	perBatch := 2.0
	tx := 4.0
	if kind == transport.SQL {
		perBatch = 1
		tx += 3
	}
	return tx + perBatch*float64(batches)/float64(n)
}

// waitCompleted waits until count sagas whose id is LIKE pattern have
// completed.
func waitCompleted(ctx context.Context, db *sql.DB, pattern string, count int) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var done int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_saga_instances WHERE state = 'completed' AND id LIKE $1`, pattern).Scan(&done); err != nil {
			return fmt.Errorf("counting completed sagas: %w", err)
		}
		if done == count {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d sagas completed before the timeout: %w", done, count, ctx.Err())
		case <-tick.C:
		}
	}
}

// hopRows turns the hop clock and the commands' history times into one
// row per hop (see Hops) for the measured sagas.
func hopRows(ctx context.Context, db *sql.DB, clock *hopClock, run Row) ([]Row, error) {
	rows, err := db.QueryContext(ctx, `SELECT saga_id, step, at FROM millwright_saga_steps WHERE kind = 'command' AND saga_id LIKE 'bench-%'`)
	if err != nil {
		return nil, fmt.Errorf("reading command times: %w", err)
	}
	defer rows.Close()
	var written, relayed, delivered, handled, toProducer, fromProducer []float64
	clock.mu.Lock()
	defer clock.mu.Unlock()
	for rows.Next() {
		var id, step string
		var at time.Time
		if err := rows.Scan(&id, &step, &at); err != nil {
			return nil, err
		}
		k := id + "\x00" + step
		com, ok0 := clock.committed[k]
		recv, ok1 := clock.received[k]
		st, ok2 := clock.started[k]
		end, ok3 := clock.done[k]
		if !ok0 || !ok1 || !ok2 || !ok3 {
			continue
		}
		written = append(written, ms(com.Sub(at)))
		relayed = append(relayed, ms(recv.Sub(com)))
		delivered = append(delivered, ms(st.Sub(recv)))
		handled = append(handled, ms(end.Sub(st)))
		if prod, ok := clock.produced[k]; ok {
			toProducer = append(toProducer, ms(prod.Sub(com)))
			fromProducer = append(fromProducer, ms(recv.Sub(prod)))
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var out []Row
	for i, xs := range [][]float64{written, relayed, delivered, handled, toProducer, fromProducer} {
		if len(xs) == 0 {
			continue
		}
		r := Row{Bench: "saga", Row: RowHop, Kind: run.Kind, Broker: run.Broker, Hop: Hops[i], Sagas: run.Sagas,
			P50: stats.Percentile(xs, 50), P99: stats.Percentile(xs, 99), Max: stats.Percentile(xs, 100)}
		if r.P50 > 0 {
			r.P99OverP50 = r.P99 / r.P50
		}
		out = append(out, r)
	}
	return out, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// parties are the orchestrator, its reply consumers' idempotency store and
// the starters, on one pool of the run's driver.
type parties struct {
	orch  *saga.Orchestrator[benchOrder]
	store *idempotency.PostgresStore
	start func(ctx context.Context, id string) error
	close func()
}

// partyConns is the parties' pool size.
const partyConns = 32

// openParties opens the parties' pool on rawURL with driver.
func openParties(ctx context.Context, driver, rawURL string, def *saga.Definition[benchOrder], scfg saga.Config) (*parties, error) {
	p, err := benchdb.Open(ctx, driver, rawURL, partyConns)
	if err != nil {
		return nil, err
	}
	ps := &parties{close: p.Close}
	ps.orch, err = benchdb.Build(p,
		func(db *sql.DB) (*saga.Orchestrator[benchOrder], error) {
			return saga.NewOrchestrator(postgres.From(db), def, scfg)
		},
		func(db *pgxpool.Pool) (*saga.Orchestrator[benchOrder], error) {
			return saga.NewOrchestrator(postgres.From(db), def, scfg)
		})
	if err == nil {
		ps.store, err = benchdb.Build(p,
			func(db *sql.DB) (*idempotency.PostgresStore, error) {
				return idempotency.NewPostgresStore(postgres.From(db))
			},
			func(db *pgxpool.Pool) (*idempotency.PostgresStore, error) {
				return idempotency.NewPostgresStore(postgres.From(db))
			})
	}
	if err != nil {
		p.Close()
		return nil, err
	}
	ps.start = func(ctx context.Context, id string) error {
		tx, err := p.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) // no-op after commit
		if err := ps.orch.Start(ctx, tx.Handle(), id, benchOrder{ID: id}); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	return ps, nil
}

// openRelayPool opens the relays' pool: on pq a database/sql pool that
// times the claim and mark statements into rt; on pgx a pgx pool, untimed.
func openRelayPool(ctx context.Context, driver, rawURL string, rt *relayTimes) (newRelay func(message.Publisher, relay.Config) (*relay.Relay, error), closePool func(), err error) {
	if driver == DriverPgx {
		// As many connections as the relays may use on pq (database/sql
		// has no limit there): pgxpool's default, max(4, cores), is 4
		// here and made the relays wait for connections.
		p, err := benchdb.Open(ctx, driver, rawURL, partyConns)
		if err != nil {
			return nil, nil, err
		}
		return func(pub message.Publisher, c relay.Config) (*relay.Relay, error) {
			return relay.New(postgres.From(p.Pgx), pub, c)
		}, p.Close, nil
	}
	db, err := openTimedDB(rawURL, rt)
	if err != nil {
		return nil, nil, err
	}
	return func(pub message.Publisher, c relay.Config) (*relay.Relay, error) {
			return relay.New(postgres.From(db), pub, c)
		},
		func() { _ = db.Close() }, nil
}

// Drivers.
const (
	DriverPQ  = benchdb.DriverPQ
	DriverPgx = benchdb.DriverPgx
)
