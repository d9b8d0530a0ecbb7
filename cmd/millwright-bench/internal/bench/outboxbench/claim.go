package outboxbench

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// discardPublisher accepts everything: the claim benchmark measures the
// database side of a relay round.
type discardPublisher struct{}

func (discardPublisher) Publish(string, ...*message.Message) error { return nil }
func (discardPublisher) Close() error                              { return nil }

func (b *bench) benchClaim(ctx context.Context, published int) error {
	// Two outboxes side by side, one empty and one holding the published
	// rows, measured in alternation so that load from elsewhere on the
	// machine hits both alike.
	big, err := b.sibling(ctx, "big")
	if err != nil {
		return err
	}
	defer big.Close()
	if _, err := big.ExecContext(ctx, `INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, status, published_at, created_at)
		SELECT 'bench-' || g, 'bench_claim', 'order', (g % 100000)::text, 'order.created.v1', $2::jsonb, 'published', now() - interval '1 hour', now() - interval '1 hour'
		FROM generate_series(1, $1::int) g`, published, string(b.payload)); err != nil {
		return err
	}
	if _, err := b.DB.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	for _, db := range []*sql.DB{b.DB, big} {
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE millwright_outbox`); err != nil {
			return err
		}
	}
	measure := func(db *sql.DB) (idle, busy float64, err error) {
		r, err := relay.New(postgres.From(db), discardPublisher{}, relay.Config{BatchSize: 100})
		if err != nil {
			return 0, 0, err
		}
		var xs []time.Duration
		for range 100 {
			start := time.Now()
			if _, err := r.RunOnce(ctx); err != nil {
				return 0, 0, err
			}
			xs = append(xs, time.Since(start))
		}
		idle = medianDur(xs)
		xs = xs[:0]
		for i := range 30 {
			evs := make([]outbox.Event, 100)
			for j := range evs {
				evs[j] = outbox.Event{Topic: "bench_claim", AggregateID: strconv.Itoa(i*100 + j), Payload: b.payload}
			}
			if err := outbox.AddOutsideTx(ctx, postgres.From(db), evs...); err != nil {
				return 0, 0, err
			}
			start := time.Now()
			n, err := r.RunOnce(ctx)
			if err != nil {
				return 0, 0, err
			}
			if n != 100 {
				return 0, 0, fmt.Errorf("claimed %d rows, want 100", n)
			}
			xs = append(xs, time.Since(start))
		}
		return idle, medianDur(xs), nil
	}
	var idle0, busy0, idle1, busy1 []float64
	for range b.Rounds {
		i0, b0, err := measure(b.DB)
		if err != nil {
			return err
		}
		i1, b1, err := measure(big)
		if err != nil {
			return err
		}
		idle0, busy0 = append(idle0, i0), append(busy0, b0)
		idle1, busy1 = append(idle1, i1), append(busy1, b1)
	}
	b.emit(Row{Case: "claim", Variant: "round, nothing due, empty table", Value: median(idle0), Unit: "ms", Runs: idle0})
	b.emit(Row{Case: "claim", Variant: fmt.Sprintf("round, nothing due, %d published rows", published), Value: median(idle1), Unit: "ms",
		Baseline: median(idle0), Ratio: median(idle1) / median(idle0), Target: "<= 1.5x", Runs: idle1})
	b.emit(Row{Case: "claim", Variant: "round of 100 rows (claim, no-op publish, mark), empty table", Value: median(busy0), Unit: "ms", Runs: busy0})
	b.emit(Row{Case: "claim", Variant: fmt.Sprintf("round of 100 rows (claim, no-op publish, mark), %d published rows", published), Value: median(busy1), Unit: "ms",
		Baseline: median(busy0), Ratio: median(busy1) / median(busy0), Target: "<= 1.5x", Runs: busy1})
	return nil
}

// sibling opens a second scratch schema (name suffix) with the outbox
// migrated, dropped when the returned pool is closed.
func (b *bench) sibling(ctx context.Context, suffix string) (*sql.DB, error) {
	u, err := url.Parse(b.URL)
	if err != nil {
		return nil, err
	}
	schemaURL, drop, err := benchdb.Schema(ctx, b.DB, b.URL, u.Query().Get("search_path")+"_"+suffix)
	if err != nil {
		return nil, err
	}
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		drop()
		return nil, err
	}
	if _, err := migrate.Up(ctx, postgres.From(db), outbox.Migrations()); err != nil {
		db.Close()
		drop()
		return nil, err
	}
	b.cleanup = append(b.cleanup, drop)
	return db, nil
}
