package outboxbench

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/lib/pq"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/roundtrips"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// Write-overhead variants: the same business transaction (BEGIN, insert an
// order row, COMMIT) alone, with one plain extra insert, with one outbox
// event written by outbox.Add, and (pgx) with the event queued by
// outbox.AddToBatch in the pgx.Batch that carries the order row.
const (
	writeBase = iota
	writePlain
	writeOutbox
	writeBatched
	writeVariants
)

// Drivers of the write section.
const (
	DriverPQ  = benchdb.DriverPQ
	DriverPgx = benchdb.DriverPgx
)

// writer runs one business transaction of a variant on one driver.
type writer interface {
	write(ctx context.Context, i int64, variant int) error
	close()
}

// benchWrite measures the write overhead on each driver of b.Drivers.
func (b *bench) benchWrite(ctx context.Context, n int) error {
	if _, err := b.DB.ExecContext(ctx, `CREATE TABLE bench_orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
		CREATE TABLE bench_order_lines (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	drivers := b.Drivers
	if len(drivers) == 0 {
		drivers = []string{DriverPQ, DriverPgx}
	}
	for _, d := range drivers {
		if err := b.benchWriteOn(ctx, d, n); err != nil {
			return fmt.Errorf("driver %s: %w", d, err)
		}
	}
	return nil
}

// openWriter opens driver's pool on rawURL.
func (b *bench) openWriter(ctx context.Context, driver, rawURL string, conns int) (writer, error) {
	p, err := benchdb.Open(ctx, driver, rawURL, conns)
	if err != nil {
		return nil, err
	}
	if p.Pgx != nil {
		return &pgxWriter{p: p.Pgx, payload: b.payload}, nil
	}
	return &pqWriter{db: p.DB, payload: b.payload}, nil
}

// benchWriteOn interleaves the variants transaction by transaction on
// every writer, so drift in the machine's speed (other jobs, checkpoints,
// the disk's flush time) hits them alike, and compares their median
// latency. Separate timed runs per variant drift apart on a shared machine
// far more than the variants differ. Round trips are counted in a
// separate pass through a counting proxy (it adds latency of its own).
func (b *bench) benchWriteOn(ctx context.Context, driver string, n int) error {
	rts, err := b.writeRoundTrips(ctx, driver)
	if err != nil {
		return fmt.Errorf("counting round trips: %w", err)
	}
	for _, writers := range []int{1, 8} {
		w, err := b.openWriter(ctx, driver, b.URL, writers)
		if err != nil {
			return err
		}
		rates, ratios, err := b.writeRounds(ctx, w, writers, n)
		w.close()
		if err != nil {
			return err
		}
		if _, err := b.DB.ExecContext(ctx, `TRUNCATE millwright_outbox, bench_orders, bench_order_lines`); err != nil {
			return err
		}
		base := median(rates[writeBase])
		pre := fmt.Sprintf("%s, %d writer(s): ", driver, writers)
		b.emit(Row{Case: "write", Variant: pre + "order row only", Value: base, Unit: "tx/s", Runs: rates[writeBase], RoundTrips: rts[writeBase]})
		b.emit(Row{Case: "write", Variant: pre + "order row + plain second insert", Value: median(rates[writePlain]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writePlain]), Runs: rates[writePlain], RoundTrips: rts[writePlain]})
		b.emit(Row{Case: "write", Variant: pre + "order row + outbox event", Value: median(rates[writeOutbox]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writeOutbox]), Target: "cost <= 1.25x", Runs: rates[writeOutbox], RoundTrips: rts[writeOutbox]})
		if driver == DriverPgx {
			b.emit(Row{Case: "write", Variant: pre + "order row + outbox event in one pgx.Batch (AddToBatch)", Value: median(rates[writeBatched]), Unit: "tx/s",
				Baseline: base, Ratio: median(ratios[writeBatched]), Target: "cost <= 1.25x", Runs: rates[writeBatched], RoundTrips: rts[writeBatched]})
		}
	}
	return nil
}

// writeRounds runs a warm-up and b.Rounds timed runs of n transactions
// per variant, and returns each variant's rate and ratio to the base per
// round.
func (b *bench) writeRounds(ctx context.Context, w writer, writers, n int) (rates, ratios [writeVariants][]float64, err error) {
	if _, err := runWrites(ctx, w, writers, n); err != nil { // warm-up
		return rates, ratios, err
	}
	for range b.Rounds {
		med, err := runWrites(ctx, w, writers, n)
		if err != nil {
			return rates, ratios, err
		}
		for v := range writeVariants {
			rates[v] = append(rates[v], float64(writers)/med[v])
			ratios[v] = append(ratios[v], med[v]/med[writeBase])
		}
	}
	return rates, ratios, nil
}

// runWrites returns the median latency of each variant, in seconds.
func runWrites(ctx context.Context, w writer, writers, n int) ([writeVariants]float64, error) {
	var next atomic.Int64
	var mu sync.Mutex
	var lat [writeVariants][]time.Duration
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine [writeVariants][]time.Duration
			defer func() {
				mu.Lock()
				for v := range writeVariants {
					lat[v] = append(lat[v], mine[v]...)
				}
				mu.Unlock()
			}()
			for i := next.Add(1); i <= int64(n)*writeVariants; i = next.Add(1) {
				v := int(i % writeVariants)
				start := time.Now()
				if err := w.write(ctx, i, v); err != nil {
					errs <- err
					return
				}
				mine[v] = append(mine[v], time.Since(start))
			}
		}()
	}
	wg.Wait()
	close(errs)
	var med [writeVariants]float64
	if err := <-errs; err != nil {
		return med, err
	}
	for v := range writeVariants {
		med[v] = medianDur(lat[v]) / 1000
	}
	return med, nil
}

// writeRoundTrips counts each variant's round trips per transaction, on
// one connection through a counting proxy, after a warm-up (pgx prepares
// each statement once per connection).
func (b *bench) writeRoundTrips(ctx context.Context, driver string) ([writeVariants]float64, error) {
	var out [writeVariants]float64
	c, u, err := roundtrips.Start(b.URL)
	if err != nil {
		return out, err
	}
	defer c.Close()
	w, err := b.openWriter(ctx, driver, u, 1)
	if err != nil {
		return out, err
	}
	defer w.close()
	const k = 20
	for v := range writeVariants {
		for i := range k { // warm-up
			if err := w.write(ctx, int64(-1-i), v); err != nil {
				return out, err
			}
		}
		before := c.Count()
		for i := range k {
			if err := w.write(ctx, int64(-1000-i), v); err != nil {
				return out, err
			}
		}
		out[v] = float64(c.Count()-before) / k
	}
	return out, nil
}

type pqWriter struct {
	db      *sql.DB
	payload []byte
}

func (w *pqWriter) close() { _ = w.db.Close() }

func (w *pqWriter) write(ctx context.Context, i int64, variant int) error {
	tx, err := w.db.BeginTx(ctx, nil)
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
	case writeOutbox, writeBatched: // database/sql has no batch: the same as Add
		if err := outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: "orders", AggregateType: "customer", AggregateID: cust, EventType: "order.created.v1", Payload: w.payload}); err != nil {
			return err
		}
	}
	return tx.Commit()
}

type pgxWriter struct {
	p       *pgxpool.Pool
	payload []byte
}

func (w *pgxWriter) close() { w.p.Close() }

func (w *pgxWriter) write(ctx context.Context, i int64, variant int) error {
	tx, err := w.p.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	cust := "c-" + strconv.FormatInt(i%5000, 10)
	const order = `INSERT INTO bench_orders (customer, total) VALUES ($1, $2)`
	if variant == writeBatched {
		b := &pgx.Batch{}
		b.Queue(order, cust, i)
		if err := outbox.AddToBatch(ctx, b, outbox.Event{Topic: "orders", AggregateType: "customer", AggregateID: cust, EventType: "order.created.v1", Payload: w.payload}); err != nil {
			return err
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	if _, err := tx.Exec(ctx, order, cust, i); err != nil {
		return err
	}
	switch variant {
	case writePlain:
		if _, err := tx.Exec(ctx, `INSERT INTO bench_order_lines (customer, total) VALUES ($1, $2)`, cust, i); err != nil {
			return err
		}
	case writeOutbox:
		if err := outbox.Add(ctx, postgres.PgxTx(tx), outbox.Event{Topic: "orders", AggregateType: "customer", AggregateID: cust, EventType: "order.created.v1", Payload: w.payload}); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}
