package sagabench

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/internal/pgconn"
)

// ExternalDTM is a figure published by another project, printed for scale
// only: it was not measured here, on other hardware, with another database.
const ExternalDTM = "external figure, not measured here: dtm reports 575 global transactions/s on a 4-core MySQL host"

// MeasureCommits returns how many single-row transactions per second
// writers sessions commit on the server admin reaches (BEGIN, one INSERT,
// COMMIT, in a scratch table), measured for d: the most write
// transactions the database allows the benchmark's writers, whatever
// those transactions hold.
func MeasureCommits(ctx context.Context, admin *sql.DB, scratch func(context.Context, string) (string, string, func(), error), writers int, d time.Duration) (float64, error) {
	_, url, drop, err := scratch(ctx, "mw_bench_ceiling")
	if err != nil {
		return 0, err
	}
	defer drop()
	db, err := pgconn.Open(url)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	db.SetMaxOpenConns(writers)
	db.SetMaxIdleConns(writers)
	if _, err := db.ExecContext(ctx, `CREATE TABLE ceiling (id BIGSERIAL PRIMARY KEY, v TEXT NOT NULL)`); err != nil {
		return 0, fmt.Errorf("creating the ceiling's table: %w", err)
	}
	one := func() error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO ceiling (v) VALUES (`+pq.QuoteLiteral("x")+`)`); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	// Warm the pool: every writer's connection open before the clock.
	var wg sync.WaitGroup
	for range writers {
		wg.Add(1)
		go func() { defer wg.Done(); _ = one() }()
	}
	wg.Wait()
	var mu sync.Mutex
	var firstErr error
	var count int64
	begin := time.Now()
	end := begin.Add(d)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var n int64
			for time.Now().Before(end) {
				if err := one(); err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
					return
				}
				n++
			}
			mu.Lock()
			count += n
			mu.Unlock()
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return 0, fmt.Errorf("committing single-row transactions: %w", firstErr)
	}
	return float64(count) / time.Since(begin).Seconds(), nil
}

// WriteJSON writes one JSON object per row.
func (r Report) WriteJSON(w io.Writer) error { return stats.WriteJSON(w, r.Rows) }

// WriteTable writes the runs, the hops and the ceiling as tables, with
// the footer that says what the figures count.
func (r Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TRANSPORT\tDRIVER\tSHAPE\tBROKER\tRUN\tSAGAS\tSAGAS/S\tP50 MS\tP99 MS\tP99/P50\tMAX MS\tVS GOCHANNEL\tVS PQ\tVS LINEAR\tTX/SAGA\tRT/SAGA\tOF CEILING")
	var hops []Row
	var ceiling *Row
	for _, row := range r.Rows {
		switch row.Row {
		case RowHop:
			hops = append(hops, row)
			continue
		case RowCeiling:
			c := row
			ceiling = &c
			continue
		}
		ratio := "-"
		switch {
		case row.VsGoChannel != 0 && row.Run == "throughput":
			ratio = fmt.Sprintf("%.2fx rate", row.VsGoChannel)
		case row.VsGoChannel != 0:
			ratio = fmt.Sprintf("%.2fx p50", row.VsGoChannel)
		}
		of := "-"
		if row.OfCeiling > 0 {
			of = fmt.Sprintf("%.0f%%", 100*row.OfCeiling)
		}
		vsPQ := "-"
		if row.VsPQ > 0 {
			vsPQ = fmt.Sprintf("%.2fx", row.VsPQ)
		}
		vsLinear := "-"
		switch {
		case row.VsLinear > 0 && row.Run == "throughput":
			vsLinear = fmt.Sprintf("%.2fx rate", row.VsLinear)
		case row.VsLinear > 0:
			vsLinear = fmt.Sprintf("%.2fx p50", row.VsLinear)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\t%s\t%s\t%s\t%.2f\t%.1f\t%s\n", row.Kind, row.Driver, row.Shape, row.Broker, row.Run, row.Sagas, row.Rate,
			row.P50, row.P99, row.P99OverP50, row.Max, ratio, vsPQ, vsLinear, row.TxPerSaga, row.RoundTrips, of)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(hops) > 0 {
		fmt.Fprintln(w, "\nwhere a step's time goes (per step, every step of every measured saga; the relay's rows time its statements")
		fmt.Fprintln(w, "and publishes within the first hop, per call):")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "TRANSPORT\tDRIVER\tSHAPE\tRUN\tHOP\tCALLS\tP50 MS\tP99 MS\tMAX MS")
		for _, h := range hops {
			calls := "-"
			if h.Calls > 0 {
				calls = fmt.Sprint(h.Calls)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.1f\t%.1f\t%.1f\n", h.Kind, h.Driver, h.Shape, h.Run, h.Hop, calls, h.P50, h.P99, h.Max)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	var schemas []string
	for _, row := range r.Rows {
		if row.Schema != "" {
			schemas = append(schemas, fmt.Sprintf("%s %s kept in schema %s", row.Kind, row.Run, row.Schema))
		}
	}
	if len(schemas) > 0 {
		fmt.Fprintln(w, strings.Join(schemas, "\n"))
	}
	if err := writeRounds(w, r.Rows); err != nil {
		return err
	}
	fmt.Fprintln(w, "\nshapes: linear runs reserve, charge, ship one after the other; parallel runs reserve and charge at once (a two-branch")
	fmt.Fprintln(w, "group), then ship; versions is linear with the parallel saga registered beside it as a second version. VS LINEAR: a shape's")
	fmt.Fprintln(w, "rate (throughput) or p50 (latency) over the linear run's of the same kind and driver in this run.")
	fmt.Fprintln(w, "sagas: 3 steps; TX/SAGA: write transactions committed per saga by all parties (orchestrator: start + 3 replies,")
	fmt.Fprintln(w, "each with its idempotency mark; relay: claim + mark per batch, shared by its rows; sql: also the transport's")
	fmt.Fprintln(w, "3 reply inserts, not its consumers' offset updates, one per batch; the participants here write nothing).")
	fmt.Fprintln(w, "RT/SAGA: round trips per saga of the orchestrator (its timeout loop included), its idempotency store and the starter")
	fmt.Fprintln(w, "(not the relay), counted by a loopback proxy their pool goes through on both drivers; VS PQ: a pgx run's rate over the pq run's of the same kind.")
	if ceiling != nil {
		fmt.Fprintf(w, "database ceiling: %.0f single-row commits/s with %d writers, measured in this run; a kind's ceiling is that / TX/SAGA,\n", ceiling.CommitsPerS, ceiling.Writers)
		fmt.Fprintln(w, "and OF CEILING its throughput as a fraction of it.")
	}
	fmt.Fprintln(w, "For scale ("+ExternalDTM+").")
	return nil
}

// writeRounds lists every round's figure of each run, when there was more
// than one round.
func writeRounds(w io.Writer, rows []Row) error {
	var lines []string
	for _, row := range rows {
		if row.Row != RowRun || row.Rounds < 2 {
			continue
		}
		figs, unit := row.RoundRates, "sagas/s"
		if row.Run == "latency" {
			figs, unit = row.RoundP99s, "ms p99"
		}
		parts := make([]string, len(figs))
		for i, f := range figs {
			parts[i] = fmt.Sprintf("%.0f", f)
		}
		lines = append(lines, fmt.Sprintf("  %s on %s, %s saga, %s: %s %s", row.Kind, row.Driver, row.Shape, row.Run, strings.Join(parts, ", "), unit))
	}
	if len(lines) == 0 {
		return nil
	}
	_, err := fmt.Fprintf(w, "\nrounds, in the order they ran (each row above is its median round, of an even count the worse middle one):\n%s\n", strings.Join(lines, "\n"))
	return err
}
