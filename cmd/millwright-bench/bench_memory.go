package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

func init() {
	cmd := &cobra.Command{
		Use:   "relay-memory",
		Short: "Peak memory of an outbox relay draining backlogs of different sizes",
		Long: `Fills a scratch schema's outbox with each --pending count of pending
300-byte events (over 1,000 aggregates), drains it with one relay into a
publisher that discards, and samples the process's heap in use and resident
set every 10 ms. The relay holds a fixed window of rows (BatchSize, plus the
next batch claimed while one is published), so the peaks should stay flat
whatever the backlog. Figures are per backlog size, after a GC between runs.`,
		RunE: runBenchMemory,
	}
	cmd.Flags().String("pending", "10000,1000000", "comma-separated backlog sizes")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	cli.AddDatabaseFlag(cmd)
	rootCmd.AddCommand(cmd)
}

// memRow is one line of the table.
type memRow struct {
	Bench        string  `json:"bench"`
	Pending      int     `json:"pending"`
	PeakHeapMiB  float64 `json:"peak_heap_inuse_mib"`
	PeakRSSMiB   float64 `json:"peak_rss_mib"`
	BaseHeapMiB  float64 `json:"baseline_heap_inuse_mib"`
	DrainSeconds float64 `json:"drain_seconds"`
	EventsPerSec float64 `json:"events_per_s"`
}

// discard publishes nowhere.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

func runBenchMemory(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	f := cmd.Flags()
	list, _ := f.GetString("pending")
	asJSON, _ := f.GetBool("json")
	var sizes []int
	for _, s := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return fmt.Errorf("--pending %q: want positive integers separated by commas", list)
		}
		sizes = append(sizes, n)
	}
	u, _ := f.GetString("database-url")
	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	out := cmd.OutOrStdout()
	if !asJSON {
		fmt.Fprintf(out, "relay memory: one relay (BatchSize 500) draining N pending 300-byte events into a discarding publisher\n")
		fmt.Fprintf(out, "%10s %16s %14s %16s %10s %12s\n", "pending", "peak heap MiB", "peak RSS MiB", "heap before MiB", "drain s", "events/s")
	}
	step, end := benchProgress(cmd)
	out = cmd.OutOrStdout() // wrapped by benchProgress on a terminal
	for i, n := range sizes {
		row, err := measureRelayMemory(ctx, admin, cli.DatabaseURL(u), n)
		if err != nil {
			return end(err)
		}
		step(i+1, len(sizes))
		if asJSON {
			_ = json.NewEncoder(out).Encode(row)
			continue
		}
		fmt.Fprintf(out, "%10d %16.1f %14.1f %16.1f %10.1f %12.0f\n", row.Pending, row.PeakHeapMiB, row.PeakRSSMiB, row.BaseHeapMiB, row.DrainSeconds, row.EventsPerSec)
	}
	return end(nil)
}

func measureRelayMemory(ctx context.Context, admin *sql.DB, base string, n int) (memRow, error) {
	row := memRow{Bench: "relay-memory", Pending: n}
	_, scratch, drop, err := benchdb.Scratch(ctx, admin, base, "bench")
	if err != nil {
		return row, err
	}
	defer drop()
	db, err := pgconn.Open(scratch)
	if err != nil {
		return row, err
	}
	defer db.Close()
	db.SetMaxOpenConns(4)
	if _, err := migrate.Up(ctx, postgres.From(db), outbox.Migrations()); err != nil {
		return row, err
	}
	payload := `{"order_id":"` + strings.Repeat("x", 270) + `"}`
	if _, err := db.ExecContext(ctx, `INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, metadata)
		SELECT 'mem-' || g, 'bench_memory', 'order', (g % 1000)::text, 'order.created.v1', $2::jsonb,
		       jsonb_build_object('ce_id', 'mem-' || g, 'ordering_key', 'order/' || (g % 1000))
		FROM generate_series(1, $1) g`, n, payload); err != nil {
		return row, fmt.Errorf("filling the outbox with %d events: %w", n, err)
	}
	if _, err := db.ExecContext(ctx, `ANALYZE millwright_outbox`); err != nil {
		return row, err
	}

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	row.BaseHeapMiB = mib(ms.HeapInuse)

	rel, err := relay.New(postgres.From(db), discard{}, relay.Config{BatchSize: 500, PollInterval: 50 * time.Millisecond})
	if err != nil {
		return row, err
	}
	var (
		peakHeap, peakRSS uint64
		mu                sync.Mutex
		stop              = make(chan struct{})
		sampled           = make(chan struct{})
	)
	go func() {
		defer close(sampled)
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			var m runtime.MemStats
			runtime.ReadMemStats(&m)
			rss := residentBytes()
			mu.Lock()
			peakHeap, peakRSS = max(peakHeap, m.HeapInuse), max(peakRSS, rss)
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	start := time.Now()
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rel.Run(rctx) }()
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Minute)
	err = outboxtest.WaitDrained(wctx, postgres.From(db))
	wcancel()
	elapsed := time.Since(start)
	cancel()
	_ = rel.Close()
	<-done
	close(stop)
	<-sampled
	if err != nil {
		return row, fmt.Errorf("draining %d events: %w", n, err)
	}
	mu.Lock()
	row.PeakHeapMiB, row.PeakRSSMiB = mib(peakHeap), mib(peakRSS)
	mu.Unlock()
	row.DrainSeconds = elapsed.Seconds()
	row.EventsPerSec = float64(n) / elapsed.Seconds()
	return row, nil
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

// residentBytes reads the process's resident set from /proc (0 elsewhere).
func residentBytes() uint64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	fields := strings.Fields(string(b))
	if len(fields) < 2 {
		return 0
	}
	pages, _ := strconv.ParseUint(fields[1], 10, 64)
	return pages * uint64(os.Getpagesize())
}
