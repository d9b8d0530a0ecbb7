package debeziumbench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/stats"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// The write variants: a business row alone, with an outbox event (what the
// relay needs), and with capture on (the trigger filling Debezium's
// columns).
const (
	variantBare    = "business row only"
	variantOutbox  = "+ outbox event"
	variantCapture = "+ outbox event, capture on"
)

const writeRounds = 3

// writeOverhead measures business transactions per second of each
// variant, alternating them for writeRounds rounds; the median round's.
func (b *bench) writeOverhead(ctx context.Context) ([]Row, error) {
	// The business table is the bench's, not millwright's.
	if _, err := b.db.ExecContext(ctx, `CREATE TABLE bench_orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, total NUMERIC NOT NULL)`); err != nil {
		return nil, err
	}
	rates := map[string][]float64{}
	for round := range writeRounds {
		for _, v := range []string{variantBare, variantOutbox, variantCapture} {
			var err error
			if v == variantCapture {
				err = storage.EnableCapture(ctx, b.q, b.name)
			} else {
				err = storage.DisableCapture(ctx, b.q, b.name)
			}
			if err != nil {
				return nil, err
			}
			r, err := b.writeRound(ctx, v, b.cfg.WriteTx)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", v, err)
			}
			b.say("write round %d/%d: %s: %.0f tx/s", round+1, writeRounds, v, r)
			rates[v] = append(rates[v], r)
		}
	}
	bare, ob, capt := stats.Median(rates[variantBare]), stats.Median(rates[variantOutbox]), stats.Median(rates[variantCapture])
	return []Row{
		row("business tx/s with one outbox event", ob, capt, "tx/s", fmt.Sprintf("%d writers; without the outbox %.0f tx/s (relay %.2fx, Debezium %.2fx of it)", b.cfg.Writers, bare, ob/bare, capt/bare)),
	}, nil
}

// writeRound runs n business transactions over the writers and returns
// their rate.
func (b *bench) writeRound(ctx context.Context, variant string, n int) (float64, error) {
	var left atomic.Int64
	left.Store(int64(n))
	var wg sync.WaitGroup
	errs := make(chan error, b.cfg.Writers)
	start := time.Now()
	for range b.cfg.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for left.Add(-1) >= 0 {
				if err := b.businessTx(ctx, variant, "bench.write"); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	select {
	case err := <-errs:
		return 0, err
	default:
	}
	// The rows are not the drain's: keep the outbox empty for it.
	if _, err := b.db.ExecContext(ctx, `TRUNCATE bench_orders`); err != nil {
		return 0, err
	}
	if err := storage.TruncateOutbox(ctx, b.q); err != nil {
		return 0, err
	}
	return float64(n) / el.Seconds(), nil
}

// businessTx is one business transaction: an order row and, unless bare,
// its outbox event.
func (b *bench) businessTx(ctx context.Context, variant, topic string) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, `INSERT INTO bench_orders (customer, total) VALUES ('c-42', 99.5)`); err != nil {
		return err
	}
	if variant != variantBare {
		if err := outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{Topic: topic, AggregateType: "order", AggregateID: "o-42", EventType: "order.placed.v1",
			Payload: []byte(`{"order_id":"o-42","customer":"c-42","total":99.5}`)}); err != nil {
			return err
		}
	}
	return tx.Commit()
}
