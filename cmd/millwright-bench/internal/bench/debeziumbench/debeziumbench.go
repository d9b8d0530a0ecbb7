// Package debeziumbench is `millwright-bench debezium`: millwright's relay
// against Debezium's outbox event router on Kafka Connect, on the same
// outbox, the same Postgres and the same Kafka, in one run:
//
//   - write: business transactions per second (one business row and one
//     outbox event each) without the outbox, with it (what the relay
//     needs), and with capture on (the trigger filling the wire columns
//     Debezium reads);
//   - drain: a backlog of --backlog events published by the relay, then
//     by Debezium from the same rows (its slot was created before them);
//   - latency: commit to consume at --rate events/s, p50 and p99, for
//     each;
//   - the WAL the slot retains while the connector is stopped.
//
// It needs a Kafka Connect worker with Debezium (scripts/connect.sh up) and
// Postgres with wal_level=logical. It works in a scratch schema and on
// topics of its own, and removes its connector, slot and publication.
package debeziumbench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/connecttest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// Config configures Run.
type Config struct {
	// DatabaseURL reaches the server; the run makes a scratch schema.
	DatabaseURL string
	// Brokers are the Kafka brokers Connect's worker writes to.
	Brokers []string
	// ConnectURL is the worker's REST API.
	ConnectURL string
	// Backlog is the drain's event count. Default 100000.
	Backlog int
	// Rate is the latency runs' events per second. Default 2000.
	Rate int
	// Duration of each latency run. Default 15s.
	Duration time.Duration
	// WriteTx is the business transactions per write variant and round.
	// Default 3000; 3 rounds, median.
	WriteTx int
	// Writers run the business transactions. Default 4.
	Writers int
	// Partitions of the run's topics. Default 6.
	Partitions int32
	// Progress, optional, gets a line per step.
	Progress io.Writer
}

func (c *Config) setDefaults() {
	if c.Backlog == 0 {
		c.Backlog = 100000
	}
	if c.Rate == 0 {
		c.Rate = 2000
	}
	if c.Duration == 0 {
		c.Duration = 15 * time.Second
	}
	if c.WriteTx == 0 {
		c.WriteTx = 3000
	}
	if c.Writers == 0 {
		c.Writers = 4
	}
	if c.Partitions == 0 {
		c.Partitions = 6
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
}

// Row is one figure.
type Row struct {
	Figure   string  `json:"figure"`
	Relay    float64 `json:"relay"`
	Debezium float64 `json:"debezium"`
	Unit     string  `json:"unit"`
	// Ratio is Debezium's figure over the relay's.
	Ratio float64 `json:"ratio"`
	Note  string  `json:"note,omitempty"`
}

// Report is a run's figures.
type Report struct{ Rows []Row }

// WriteTable prints the rows.
func (r Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tRELAY\tDEBEZIUM\tUNIT\tDEBEZIUM/RELAY\tNOTE")
	for _, x := range r.Rows {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%s\t%.2f\t%s\n", x.Figure, x.Relay, x.Debezium, x.Unit, x.Ratio, x.Note)
	}
	return tw.Flush()
}

// WriteJSON prints one JSON object per row.
func (r Report) WriteJSON(w io.Writer) error { return stats.WriteJSON(w, r.Rows) }

func row(figure string, relay, dbz float64, unit, note string) Row {
	r := Row{Figure: figure, Relay: relay, Debezium: dbz, Unit: unit, Note: note}
	if relay != 0 {
		r.Ratio = dbz / relay
	}
	return r
}

// bench is one run's shared state.
type bench struct {
	cfg     Config
	db      *sql.DB
	q       storage.Querier
	schema  string
	url     string
	name    string // connector, slot, publication
	connect *connecttest.Client
}

// Run runs every measurement and returns the figures.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg.setDefaults()
	b, drop, err := open(ctx, cfg)
	if err != nil {
		return Report{}, err
	}
	defer drop()
	var rep Report
	w, err := b.writeOverhead(ctx)
	if err != nil {
		return rep, fmt.Errorf("write overhead: %w", err)
	}
	rep.Rows = append(rep.Rows, w...)
	d, err := b.drain(ctx)
	if err != nil {
		return rep, fmt.Errorf("drain: %w", err)
	}
	rep.Rows = append(rep.Rows, d...)
	l, err := b.latency(ctx)
	if err != nil {
		return rep, fmt.Errorf("latency: %w", err)
	}
	rep.Rows = append(rep.Rows, l...)
	return rep, nil
}

func open(ctx context.Context, cfg Config) (*bench, func(), error) {
	b := &bench{cfg: cfg, connect: connecttest.New(cfg.ConnectURL)}
	admin, err := pgconn.Open(cfg.DatabaseURL)
	if err != nil {
		return nil, nil, err
	}
	var dropSchema func()
	if b.schema, b.url, dropSchema, err = benchdb.Scratch(ctx, admin, cfg.DatabaseURL, "mw_dbz"); err != nil {
		admin.Close()
		return nil, nil, err
	}
	b.name = b.schema
	if b.db, err = pgconn.Open(b.url); err == nil {
		b.db.SetMaxOpenConns(cfg.Writers + 8)
		b.q = storage.NewSQLPool(b.db)
		_, err = migrate.Up(ctx, postgres.From(b.db), outbox.Migrations())
	}
	drop := func() {
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_ = b.connect.Delete(c, b.name)
		b.dropSlot(c)
		if b.q != nil {
			_ = storage.DisableCapture(c, b.q, b.name)
		}
		if b.db != nil {
			b.db.Close()
		}
		dropSchema()
		admin.Close()
	}
	if err != nil {
		drop()
		return nil, nil, err
	}
	return b, drop, nil
}

// dropSlot drops the run's slot once the connector's task has let go.
func (b *bench) dropSlot(ctx context.Context) {
	for ctx.Err() == nil {
		err := storage.DropCaptureSlot(ctx, b.q, b.name)
		if err == nil || !strings.Contains(err.Error(), "is active") {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (b *bench) say(format string, args ...any) {
	fmt.Fprintf(b.cfg.Progress, "bench debezium: "+format+"\n", args...)
}

// Command is `millwright-bench debezium`.
func Command() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "debezium",
		Short: "millwright's relay vs Debezium on Kafka Connect: write overhead, backlog drain, commit-to-consume latency",
		Long: `Relays one outbox by millwright's relay and by Debezium's outbox event router on
a Kafka Connect worker (scripts/connect.sh up), on the same Postgres and Kafka,
and prints: business transactions per second without the outbox, with it, and
with capture on (the trigger Debezium's columns need); the drain rate of a
--backlog event backlog by each; commit-to-consume latency p50/p99 at --rate
events/s for each; the WAL the slot retains while the connector is stopped.
Works in a scratch schema and topics of its own.`,
		Args: cobra.NoArgs,
		RunE: runCommand,
	}
	cmd.Flags().Int("backlog", 100000, "events in the drain backlog")
	cmd.Flags().Int("rate", 2000, "events per second of the latency runs")
	cmd.Flags().Duration("duration", 15*time.Second, "length of each latency run")
	cmd.Flags().Int("write-tx", 3000, "business transactions per write variant and round")
	cmd.Flags().String("database-url", "", "Postgres URL (default $MILLWRIGHT_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/test?sslmode=disable); wal_level must be logical")
	cmd.Flags().String("brokers", "", "Kafka brokers, comma-separated (default $MILLWRIGHT_TEST_KAFKA_BROKERS, else 127.0.0.1:9092): the ones the Connect worker writes to")
	cmd.Flags().String("connect-url", "", "Kafka Connect REST URL (default $"+connecttest.EnvURL+", else http://127.0.0.1:8083)")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	return cmd
}

func flagOr(cmd *cobra.Command, name, env, def string) string {
	if v, _ := cmd.Flags().GetString(name); v != "" {
		return v
	}
	if v := os.Getenv(env); v != "" {
		return v
	}
	return def
}

func runCommand(cmd *cobra.Command, _ []string) error {
	var cfg Config
	cfg.Backlog, _ = cmd.Flags().GetInt("backlog")
	cfg.Rate, _ = cmd.Flags().GetInt("rate")
	cfg.Duration, _ = cmd.Flags().GetDuration("duration")
	cfg.WriteTx, _ = cmd.Flags().GetInt("write-tx")
	if cfg.Backlog < 1 || cfg.Rate < 1 || cfg.Duration < time.Second || cfg.WriteTx < 1 {
		return errors.New("bench debezium: --backlog, --rate and --write-tx must be at least 1, --duration at least 1s")
	}
	cfg.DatabaseURL = flagOr(cmd, "database-url", "MILLWRIGHT_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	cfg.Brokers = strings.Split(flagOr(cmd, "brokers", "MILLWRIGHT_TEST_KAFKA_BROKERS", "127.0.0.1:9092"), ",")
	cfg.ConnectURL = flagOr(cmd, "connect-url", connecttest.EnvURL, "http://127.0.0.1:8083")
	cfg.Progress = cmd.ErrOrStderr()
	rep, err := Run(cmd.Context(), cfg)
	if err != nil {
		return fmt.Errorf("bench debezium: %w", err)
	}
	if j, _ := cmd.Flags().GetBool("json"); j {
		return rep.WriteJSON(cmd.OutOrStdout())
	}
	return rep.WriteTable(cmd.OutOrStdout())
}
