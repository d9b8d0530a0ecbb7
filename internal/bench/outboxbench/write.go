package outboxbench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lib/pq"

	"github.com/millwright/millwright/outbox"
)

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
// disk's flush time) hits them alike, and compares their median latency.
// Separate timed runs per variant drift apart on a shared machine far more
// than the variants differ.
func (b *bench) benchWrite(ctx context.Context, n int) error {
	if _, err := b.DB.ExecContext(ctx, `CREATE TABLE bench_orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
		CREATE TABLE bench_order_lines (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	// run returns the median latency of each variant, in seconds.
	run := func(writers int) ([writeVariants]float64, error) {
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
					if err := b.oneWrite(ctx, i, v); err != nil {
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
	for _, writers := range []int{1, 8} {
		if _, err := run(writers); err != nil { // warm-up
			return err
		}
		var rates [writeVariants][]float64
		var ratios [writeVariants][]float64
		for range b.Rounds {
			med, err := run(writers)
			if err != nil {
				return err
			}
			for v := range writeVariants {
				rates[v] = append(rates[v], float64(writers)/med[v])
				ratios[v] = append(ratios[v], med[v]/med[writeBase])
			}
		}
		if _, err := b.DB.ExecContext(ctx, `TRUNCATE millwright_outbox, bench_orders, bench_order_lines`); err != nil {
			return err
		}
		base := median(rates[writeBase])
		b.emit(Row{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row only", writers), Value: base, Unit: "tx/s", Runs: rates[writeBase]})
		b.emit(Row{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row + plain second insert", writers), Value: median(rates[writePlain]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writePlain]), Runs: rates[writePlain]})
		b.emit(Row{Case: "write", Variant: fmt.Sprintf("%d writer(s): order row + outbox event", writers), Value: median(rates[writeOutbox]), Unit: "tx/s",
			Baseline: base, Ratio: median(ratios[writeOutbox]), Target: "cost <= 1.35x", Runs: rates[writeOutbox]})
	}
	return nil
}

func (b *bench) oneWrite(ctx context.Context, i int64, variant int) error {
	tx, err := b.DB.BeginTx(ctx, nil)
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
