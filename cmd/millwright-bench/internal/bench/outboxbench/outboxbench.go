// Package outboxbench is `millwright-bench outbox`: the outbox's write
// overhead, drain rate beside bare loops and Watermill's forwarder, claim
// cost over a large table, and commit-to-consumer latency. Every figure is
// the median of Config.Rounds runs, and every ratio is against a baseline
// measured in the same process, in the same run.
package outboxbench

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // the bench runs any kind its flags name
)

// Sections of the benchmark, in the order they run.
const (
	SectionWrite   = "write"
	SectionDrain   = "drain"
	SectionClaim   = "claim"
	SectionLatency = "latency"
)

// Broker is a transport configuration for one section and what to do
// after it.
type Broker struct {
	// Config opens the transport.
	Config transport.Config
	// Label names the broker in the rows ("kfake", "kafka HOST:PORT", ...).
	Label string
	// Done, if not nil, runs after the section with the topics it used
	// (to drop them from a real broker) and releases the broker.
	Done func(ctx context.Context, topics []string)
}

// Config is one run of the benchmark.
type Config struct {
	// DB reaches a scratch schema with the outbox migrated; URL is its
	// URL (for LISTEN and sibling schemas).
	DB  *sql.DB
	URL string
	// Rounds is the number of runs per figure (the median is reported).
	Rounds int
	// Writes is the number of transactions per write-overhead run.
	Writes int
	// Backlog is the number of events per drain run, spread over
	// Aggregates aggregates.
	Backlog, Aggregates int
	// HotPercent of the backlog's events (0..100) belong to one more
	// aggregate, "hot" (one lane: one relay publishes them, in order).
	HotPercent int
	// Relays are the relay counts of the drain (the bare loop runs at the
	// same counts).
	Relays []int
	// PublishedRows is the size of the table in the claim section.
	PublishedRows int
	// Rate (events/s) and LatencyDuration shape each latency run.
	Rate            int
	LatencyDuration time.Duration
	// NoForwarders leaves Watermill's forwarder out of the latency
	// section: the relay alone (at 2,000 events/s a forwarder run at
	// its 1 s poll lasts minutes, as its backlog drains).
	NoForwarders bool
	// Sections to run (SectionWrite, ...).
	Sections []string
	// Drivers the write section runs on, in order: DriverPQ (lib/pq
	// through pgconn.Open, as postgres.Open), DriverPgx (pgxpool). Default
	// both.
	Drivers []string
	// Kinds are the transports of the drain and latency sections, opened
	// with Open.
	Kinds []transport.Kind
	Open  func(transport.Kind) (Broker, error)
	// Group is the consumer group the latency section consumes with.
	Group string
	// Out receives the table (or, with JSON, one object per row);
	// Progress, if not nil, what is being measured and what was skipped.
	Out      io.Writer
	JSON     bool
	Progress func(format string, args ...any)
	// Step, if set, is called after each part (a section, or a section's
	// run on one kind, skipped or not) with the parts done and the parts
	// in all. Default nil.
	Step func(done, total int)
}

// Row is one line of the table, and one object with --json.
type Row struct {
	Bench    string  `json:"bench"`
	Case     string  `json:"case"`
	Variant  string  `json:"variant"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Baseline float64 `json:"baseline,omitempty"`
	// Ratio is Value over Baseline; for a drain's relay row, the median of
	// each round's relay run over that round's bare loop run.
	Ratio  float64 `json:"ratio,omitempty"`
	Target string  `json:"target,omitempty"`
	// Broker is what a drain or latency row ran on; empty for the
	// Postgres-only sections.
	Broker string `json:"broker,omitempty"`
	// VsForwarder is Value over Watermill's forwarder in the same run.
	VsForwarder float64 `json:"vs_forwarder,omitempty"`
	// VsPublisher is Value over the transport's Watermill publisher alone,
	// without a database, in the same run.
	VsPublisher float64 `json:"vs_publisher,omitempty"`
	// VsFewer is, for a drain's relay row, the median of each round's run
	// over that round's run with the relay count before (1 for 2, 2 for 4).
	VsFewer float64 `json:"vs_fewer,omitempty"`
	// RoundTrips is the client's round trips per operation (a write's
	// transaction), counted through a proxy in a separate pass.
	RoundTrips float64   `json:"round_trips,omitempty"`
	Runs       []float64 `json:"runs"`
	// NotRun says why a section asked for did not run on a kind (its
	// broker unreachable, a run that failed); Value is then meaningless.
	NotRun string `json:"not_run,omitempty"`
}

type bench struct {
	Config
	payload     []byte
	horizonRows []Row // the sql latency run's horizon holders (latency.go)
	rows        []Row
	cleanup     []func()
	// broker labels the rows of the section withTransport runs; empty
	// outside it.
	broker string
	// topics are the broker topics the section created.
	topics []string
	// noCheckpoint: CHECKPOINT was refused (said once, not asked again).
	noCheckpoint bool
}

// Run runs the sections cfg names and prints the rows.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Progress == nil {
		cfg.Progress = func(string, ...any) {}
	}
	b := &bench{Config: cfg, payload: payload()}
	defer func() {
		for _, f := range b.cleanup {
			f()
		}
	}()
	want := map[string]bool{}
	for _, s := range cfg.Sections {
		want[s] = true
	}
	if want[SectionDrain] && len(cfg.Relays) == 0 {
		// A configuration error, not a broker failure: refused before any
		// section runs, not skipped per broker below.
		return errors.New("drain: no relay counts (Config.Relays)")
	}
	total := cfg.parts(want)
	done := 0
	step := func() {
		done++
		if cfg.Step != nil {
			cfg.Step(done, total)
		}
	}
	if want[SectionWrite] {
		cfg.Progress("write overhead ...")
		if err := b.benchWrite(ctx, cfg.Writes); err != nil {
			return fmt.Errorf("write overhead: %w", err)
		}
		step()
	}
	if want[SectionDrain] {
		b.onEachKind(ctx, SectionDrain, "drain", b.benchDrain, step)
	}
	if want[SectionClaim] && cfg.PublishedRows > 0 {
		cfg.Progress("claim cost (inserting %d published rows) ...", cfg.PublishedRows)
		if err := b.benchClaim(ctx, cfg.PublishedRows); err != nil {
			return fmt.Errorf("claim: %w", err)
		}
		step()
	}
	if want[SectionRetention] && cfg.PublishedRows > 0 {
		cfg.Progress("retention (removing %d published rows) ...", cfg.PublishedRows)
		if err := b.benchRetention(ctx, cfg.PublishedRows); err != nil {
			return fmt.Errorf("retention: %w", err)
		}
		step()
	}
	if want[SectionLatency] {
		b.onEachKind(ctx, SectionLatency, "latency", b.benchLatency, step)
	}
	if cfg.JSON {
		return nil
	}
	return b.print()
}

// parts is how many steps the wanted sections make (Config.Step's total).
func (c Config) parts(want map[string]bool) int {
	total := 0
	for _, s := range []struct {
		on    bool
		parts int
	}{
		{want[SectionWrite], 1}, {want[SectionDrain], len(c.Kinds)},
		{want[SectionClaim] && c.PublishedRows > 0, 1}, {want[SectionRetention] && c.PublishedRows > 0, 1},
		{want[SectionLatency], len(c.Kinds)},
	} {
		if s.on {
			total += s.parts
		}
	}
	return total
}

// onEachKind runs a per-broker section (label in the progress lines) on
// every kind, one step each. One broker being unavailable does not void
// the others: its failure is reported and the section noted as not run
// there.
func (b *bench) onEachKind(ctx context.Context, section, label string, run func(context.Context, string, *transport.Transport) error, step func()) {
	for _, k := range b.Kinds {
		b.Progress("%s via %s ...", label, k)
		if err := b.withTransport(ctx, k, func(t *transport.Transport) error { return run(ctx, string(k), t) }); err != nil {
			b.Progress("%s via %s: %v (skipped)", label, k, err)
			b.notRun(section, k, err)
		}
		step()
	}
}

// payload is a 300-byte JSON order.
func payload() []byte {
	p := []byte(`{"order_id":"00000000-0000-0000-0000-000000000000","customer":"c-000000","currency":"EUR","items":[{"sku":"sku-0001","qty":1,"price":1999},{"sku":"sku-0002","qty":2,"price":599}],"note":"`)
	for len(p) < 297 {
		p = append(p, 'x')
	}
	return append(p, `"}`...)
}

func (b *bench) emit(r Row) {
	r.Bench = "outbox"
	r.Broker = b.broker
	if b.JSON {
		_ = json.NewEncoder(b.Out).Encode(r)
	}
	b.rows = append(b.rows, r)
}

// notRun records that section did not run on kind, as a row of the table
// (and of --json): a kind asked for is never silently missing.
func (b *bench) notRun(section string, kind transport.Kind, err error) {
	b.emit(Row{Case: section + " " + string(kind), Variant: "every variant", Unit: "-", NotRun: err.Error()})
}

func (b *bench) print() error {
	tw := tabwriter.NewWriter(b.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "CASE\tBROKER\tVARIANT\tVALUE\tUNIT\tBASELINE\tRATIO\tROUND TRIPS\tVS FEWER\tVS FORWARDER\tVS PUBLISHER\tTARGET\n")
	x := func(v float64) string {
		if v == 0 {
			return ""
		}
		return strconv.FormatFloat(v, 'f', 2, 64) + "x"
	}
	for _, r := range b.rows {
		base := ""
		if r.Baseline != 0 {
			base = strconv.FormatFloat(r.Baseline, 'f', 2, 64)
		}
		broker := r.Broker
		if broker == "" {
			broker = "-"
		}
		rt := ""
		if r.RoundTrips != 0 {
			rt = strconv.FormatFloat(r.RoundTrips, 'f', 1, 64)
		}
		if r.NotRun != "" {
			fmt.Fprintf(tw, "%s\t%s\t%s: not run: %s\t-\t-\t\t\t\t\t\t\t%s\n", r.Case, broker, r.Variant, strings.ReplaceAll(r.NotRun, "\t", " "), r.Target)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.2f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Case, broker, r.Variant, r.Value, r.Unit, base,
			x(r.Ratio), rt, x(r.VsFewer), x(r.VsForwarder), x(r.VsPublisher), r.Target)
	}
	fmt.Fprintf(tw, "(medians of %d runs)\n", b.Rounds)
	return tw.Flush()
}

// withTransport opens a transport of the given kind for one section and
// labels the section's rows with its broker.
func (b *bench) withTransport(ctx context.Context, kind transport.Kind, f func(*transport.Transport) error) error {
	br, err := b.Open(kind)
	if err != nil {
		return err
	}
	b.broker = br.Label
	defer func() {
		if br.Done != nil {
			br.Done(context.WithoutCancel(ctx), b.topics)
		}
		b.broker, b.topics = "", nil
	}()
	cfg := br.Config
	cfg.WaitForBroker = transport.NoWait // a benchmark fails at once on a broker that is down
	t, err := transport.Open(ctx, cfg)
	if err != nil {
		return err
	}
	defer t.Close()
	return f(t)
}

// median is the one statistic of the benchmark.
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

func medianDur(xs []time.Duration) float64 {
	fs := make([]float64, len(xs))
	for i, x := range xs {
		fs[i] = float64(x) / float64(time.Millisecond)
	}
	return median(fs)
}
