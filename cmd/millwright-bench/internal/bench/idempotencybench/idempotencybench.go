// Package idempotencybench is `millwright-bench idempotency`: the cost of
// the idempotency middleware over the handler it wraps, a handler
// inserting one row, fed straight from goroutines without a broker so the
// figures isolate the middleware.
package idempotencybench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/roundtrips"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

// Budget is the most the transactional middleware may cost, as the
// baseline's rate over its own.
const Budget = 1.15

// Config configures Run.
type Config struct {
	// DB is a pool on a scratch schema with idempotency.Migrations()
	// applied; Run creates its effects table there. Required.
	DB *sql.DB
	// URL reaches the same schema: Run opens each driver's pool on it
	// (Workers connections), and one through a round-trip counter.
	// Required.
	URL string
	// Drivers to measure on, in order: "pq" (lib/pq through pgconn.Open,
	// as postgres.Open), "pgx" (pgxpool). Default both.
	Drivers []string
	// Messages per variant and round. Default 4000.
	Messages int
	// Workers are concurrent handlers, each holding one connection.
	// Default 8.
	Workers int
	// Rounds of every variant, alternating, so that load on the machine
	// falls on all of them; the median round is reported. Default 5.
	Rounds int
	// Progress receives a line per round. Default io.Discard.
	Progress io.Writer
	// Step, if set, is called after each timed run with the runs done and
	// the runs in all (Rounds times the variants). Default nil.
	Step func(done, total int)
}

func (c *Config) setDefaults() {
	if c.Messages == 0 {
		c.Messages = 4000
	}
	if c.Workers == 0 {
		c.Workers = 8
	}
	if c.Rounds == 0 {
		c.Rounds = 5
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	if len(c.Drivers) == 0 {
		c.Drivers = []string{DriverPQ, DriverPgx}
	}
}

// Drivers.
const (
	DriverPQ  = benchdb.DriverPQ
	DriverPgx = benchdb.DriverPgx
)

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if c.DB == nil || c.URL == "" {
		errs = append(errs, errors.New("bench idempotency: Config.DB and Config.URL are required"))
	}
	for _, d := range c.Drivers {
		if d != DriverPQ && d != DriverPgx {
			errs = append(errs, fmt.Errorf("bench idempotency: driver %q: want pq or pgx", d))
		}
	}
	if c.Messages < 1 || c.Workers < 1 || c.Rounds < 1 {
		errs = append(errs, fmt.Errorf("bench idempotency: --messages %d, --workers %d and --rounds %d must be at least 1", c.Messages, c.Workers, c.Rounds))
	}
	return errors.Join(errs...)
}

// Row is one variant's figures, and one --json object.
type Row struct {
	Bench    string `json:"bench"` // "idempotency"
	Driver   string `json:"driver"`
	Variant  string `json:"variant"`
	Messages int    `json:"messages"`
	Workers  int    `json:"workers"`
	Rounds   int    `json:"rounds"`
	// Rate is the median round's messages/s.
	Rate float64 `json:"msgs_per_s"`
	// P50 and P99 are per-message handler latencies, median over rounds,
	// in milliseconds.
	P50 float64 `json:"p50_ms"`
	P99 float64 `json:"p99_ms"`
	// Cost is the baseline's rate over this variant's, in the same round,
	// median over rounds.
	Cost float64 `json:"cost"`
	// Budget is Budget for the transactional middleware, else absent.
	Budget float64 `json:"budget,omitempty"`
	// RoundTrips is the client's round trips per message, counted through
	// a proxy in a separate pass of one worker.
	RoundTrips float64 `json:"round_trips"`
}

// Report is what Run measured: the baseline first.
type Report struct {
	Rows []Row
}

type round struct {
	rate, p50, p99 float64
}

// Run measures, on each driver, the handler alone (its own transaction),
// then behind the middleware in Transactional mode (the mark is one more
// insert in the handler's transaction) and in MarkAfterSuccess mode.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	if _, err := cfg.DB.ExecContext(ctx, `CREATE TABLE bench_effects (event_id TEXT NOT NULL, payload TEXT NOT NULL)`); err != nil {
		return Report{}, fmt.Errorf("creating bench_effects: %w", err)
	}
	var rep Report
	for _, d := range cfg.Drivers {
		rows, err := runDriver(ctx, cfg, d)
		if err != nil {
			return Report{}, fmt.Errorf("driver %s: %w", d, err)
		}
		rep.Rows = append(rep.Rows, rows...)
	}
	return rep, nil
}

type variant struct {
	name string
	h    message.HandlerFunc
}

// pool is one driver's pool (the handler's own transactions) and the
// store on it.
type pool struct {
	*benchdb.Pool
	store *idempotency.PostgresStore
}

// openPool opens driver's pool on rawURL with conns connections.
func openPool(ctx context.Context, driver, rawURL string, conns int) (*pool, error) {
	p, err := benchdb.Open(ctx, driver, rawURL, conns)
	if err != nil {
		return nil, err
	}
	store, err := benchdb.Build(p,
		func(db *sql.DB) (*idempotency.PostgresStore, error) {
			return idempotency.NewPostgresStore(postgres.From(db))
		},
		func(db *pgxpool.Pool) (*idempotency.PostgresStore, error) {
			return idempotency.NewPostgresStore(postgres.From(db))
		})
	if err != nil {
		p.Close()
		return nil, err
	}
	return &pool{Pool: p, store: store}, nil
}

// variants returns the baseline handler and the middleware's modes over
// it, on p.
func variants(p *pool) ([]variant, error) {
	handler := func(msg *message.Message) ([]*message.Message, error) {
		mctx := msg.Context()
		const insert = `INSERT INTO bench_effects (event_id, payload) VALUES ($1, $2)`
		id, body := msg.Metadata.Get(metadata.EventID), string(msg.Payload)
		if pt, ok := idempotency.TxFromContext(mctx); ok && pt.SQL() != nil {
			tx := pt.SQL()
			_, err := tx.ExecContext(mctx, insert, id, body)
			return nil, err
		}
		if pt, ok := idempotency.TxFromContext(mctx); ok && pt.Pgx() != nil {
			tx := pt.Pgx()
			_, err := tx.Exec(mctx, insert, id, body)
			return nil, err
		}
		tx, err := p.Begin(mctx)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback(mctx)
		if err := tx.Exec(mctx, insert, id, body); err != nil {
			return nil, err
		}
		return nil, tx.Commit(mctx)
	}
	vs := []variant{{name: "baseline (no middleware)", h: handler}}
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.MarkAfterSuccess} {
		mw, err := idempotency.NewMiddleware(p.store, idempotency.Config{
			Consumer: "bench-" + mode.String(), Mode: mode, Registerer: prometheus.NewRegistry(),
		})
		if err != nil {
			return nil, err
		}
		vs = append(vs, variant{name: "middleware " + mode.String(), h: mw.Middleware(handler)})
	}
	return vs, nil
}

// runDriver measures every variant on driver.
func runDriver(ctx context.Context, cfg Config, driver string) ([]Row, error) {
	rts, err := roundTrips(ctx, cfg, driver)
	if err != nil {
		return nil, fmt.Errorf("counting round trips: %w", err)
	}
	p, err := openPool(ctx, driver, cfg.URL, cfg.Workers)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	vs, err := variants(p)
	if err != nil {
		return nil, err
	}
	// Warm the pool and the plans.
	if _, err := feed(ctx, vs[0].h, driver+"-warmup", min(cfg.Messages, 200), cfg.Workers); err != nil {
		return nil, err
	}
	rounds, err := runRounds(ctx, cfg, driver, vs)
	if err != nil {
		return nil, err
	}
	var rows []Row
	for i, v := range vs {
		var rates, p50s, p99s, costs []float64
		for r, res := range rounds[i] {
			rates, p50s, p99s = append(rates, res.rate), append(p50s, res.p50), append(p99s, res.p99)
			costs = append(costs, rounds[0][r].rate/res.rate)
		}
		row := Row{Bench: "idempotency", Driver: driver, Variant: v.name, Messages: cfg.Messages, Workers: cfg.Workers, Rounds: cfg.Rounds,
			Rate: stats.Median(rates), P50: stats.Median(p50s), P99: stats.Median(p99s), Cost: stats.Median(costs), RoundTrips: rts[i]}
		if i == 1 {
			row.Budget = Budget
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// runRounds alternates the variants for cfg.Rounds rounds.
func runRounds(ctx context.Context, cfg Config, driver string, vs []variant) ([][]round, error) {
	rounds := make([][]round, len(vs))
	step := func() {}
	if cfg.Step != nil {
		done, total := 0, cfg.Rounds*len(vs)*len(cfg.Drivers)
		if driver != cfg.Drivers[0] {
			done = cfg.Rounds * len(vs)
		}
		step = func() { done++; cfg.Step(done, total) }
	}
	for r := range cfg.Rounds {
		fmt.Fprintf(cfg.Progress, "%s: round %d of %d ...\n", driver, r+1, cfg.Rounds)
		// Each round starts with another variant, so that none always
		// runs first (right after the previous round's last one).
		for j := range vs {
			i := (r + j) % len(vs)
			v := vs[i]
			res, err := feed(ctx, v.h, fmt.Sprintf("%s-%s-r%d", driver, v.name, r), cfg.Messages, cfg.Workers)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", v.name, err)
			}
			rounds[i] = append(rounds[i], res)
			step()
		}
	}
	return rounds, nil
}

// roundTrips counts each variant's round trips per message, one worker
// on one connection through a counting proxy, after a warm-up.
func roundTrips(ctx context.Context, cfg Config, driver string) ([]float64, error) {
	c, u, err := roundtrips.Start(cfg.URL)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	p, err := openPool(ctx, driver, u, 1)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	vs, err := variants(p)
	if err != nil {
		return nil, err
	}
	const k = 50
	out := make([]float64, len(vs))
	for i, v := range vs {
		if _, err := feed(ctx, v.h, driver+"-rt-warm-"+v.name, k, 1); err != nil {
			return nil, err
		}
		before := c.Count()
		if _, err := feed(ctx, v.h, driver+"-rt-"+v.name, k, 1); err != nil {
			return nil, err
		}
		out[i] = float64(c.Count()-before) / k
	}
	return out, nil
}

// feed feeds n messages with unique event ids to h from workers
// goroutines and measures throughput and per-message latency.
func feed(ctx context.Context, h message.HandlerFunc, prefix string, n, workers int) (round, error) {
	jobs := make(chan int)
	lat := make([]time.Duration, n)
	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				msg := message.NewMessage(watermill.NewUUID(), []byte("payload"))
				msg.Metadata.Set(metadata.EventID, fmt.Sprintf("%s-%d", prefix, i))
				msg.SetContext(ctx)
				t0 := time.Now()
				_, err := h(msg)
				lat[i] = time.Since(t0)
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return round{}, firstErr
	}
	ms := stats.Millis(lat)
	return round{rate: float64(n) / elapsed.Seconds(), p50: stats.Percentile(ms, 50), p99: stats.Percentile(ms, 99)}, nil
}

// WriteJSON writes one JSON object per row.
func (r Report) WriteJSON(w io.Writer) error { return stats.WriteJSON(w, r.Rows) }

// WriteTable writes the rows and the transactional middleware's verdict.
func (r Report) WriteTable(w io.Writer) error {
	if len(r.Rows) == 0 {
		return nil
	}
	b := r.Rows[0]
	fmt.Fprintf(w, "handler inserting one row; %d messages x %d workers, median of %d rounds\n", b.Messages, b.Workers, b.Rounds)
	fmt.Fprintf(w, "%-6s %-36s %10s %10s %10s %8s %12s\n", "DRIVER", "VARIANT", "MSG/S", "P50 MS", "P99 MS", "COST", "ROUND TRIPS")
	for _, row := range r.Rows {
		fmt.Fprintf(w, "%-6s %-36s %10.0f %10.2f %10.2f %7.2fx %12.1f\n", row.Driver, row.Variant, row.Rate, row.P50, row.P99, row.Cost, row.RoundTrips)
	}
	for _, row := range r.Rows {
		if row.Budget == 0 {
			continue
		}
		verdict := "within"
		if row.Cost > row.Budget {
			verdict = "OVER"
		}
		fmt.Fprintf(w, "%s: %s costs %.2fx the baseline (%s the %.2fx budget; COST is the median of the rounds' ratios)\n", row.Driver, row.Variant, row.Cost, verdict, row.Budget)
	}
	return nil
}
