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
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// latencyRun is one relay's commit-to-consume figures.
type latencyRun struct {
	rate     float64 // events/s written
	p50, p99 float64 // ms
}

// latency measures Debezium (its connector running since the drain,
// capture on), then stops the connector and measures the relay (capture
// off, LISTEN wake-ups), reading meanwhile the WAL the stopped slot
// retains.
func (b *bench) latency(ctx context.Context) ([]Row, error) {
	dbz, err := b.latencyRun(ctx, b.schema+"_lat_dbz", nil)
	if err != nil {
		return nil, fmt.Errorf("Debezium: %w", err)
	}
	if err := b.connect.Stop(ctx, b.name); err != nil {
		return nil, err
	}
	if err := storage.DisableCapture(ctx, b.q, b.name); err != nil {
		return nil, err
	}
	before, err := b.slotWAL(ctx)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	tr, err := b.openTransport(ctx)
	if err != nil {
		return nil, err
	}
	defer tr.Close()
	r, err := relay.New(postgres.From(b.db), tr.Publisher(), relay.Config{ListenURL: b.url})
	if err != nil {
		return nil, err
	}
	rel, err := b.latencyRun(ctx, b.schema+"_lat_relay", r)
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	after, err := b.slotWAL(ctx)
	if err != nil {
		return nil, err
	}
	down := time.Since(t0)
	walRate := float64(after-before) / down.Seconds()
	b.say("slot %s retained %d bytes more WAL in %s with its connector stopped (%.0f bytes/s)", b.name, after-before, down.Round(time.Millisecond), walRate)
	note := fmt.Sprintf("written at %.0f (relay) and %.0f (Debezium) events/s", rel.rate, dbz.rate)
	return []Row{
		row(fmt.Sprintf("commit->consume p50 at %d events/s", b.cfg.Rate), rel.p50, dbz.p50, "ms", note),
		row(fmt.Sprintf("commit->consume p99 at %d events/s", b.cfg.Rate), rel.p99, dbz.p99, "ms", note),
		row("WAL retained while the connector is stopped", 0, walRate/1024, "KiB/s",
			fmt.Sprintf("%.1f MiB in %s, at %.0f events/s plus what the server's other databases write", float64(after-before)/(1<<20), down.Round(time.Second), rel.rate)),
	}, nil
}

func (b *bench) slotWAL(ctx context.Context) (int64, error) {
	lags, err := storage.ReadSlotLag(ctx, b.q)
	if err != nil {
		return 0, err
	}
	for _, l := range lags {
		if l.Slot == b.name {
			return l.Retained, nil
		}
	}
	return 0, fmt.Errorf("slot %s not found in pg_replication_slots", b.name)
}

// latencyRun writes events to topic at cfg.Rate for cfg.Duration, one per
// business transaction, with relay running (nil: Debezium relays), and
// returns commit-to-first-arrival percentiles.
func (b *bench) latencyRun(ctx context.Context, topic string, rel *relay.Relay) (latencyRun, error) {
	if err := b.createTopic(ctx, topic); err != nil {
		return latencyRun{}, err
	}
	defer b.deleteTopics(topic)
	arr, err := b.consume(topic)
	if err != nil {
		return latencyRun{}, err
	}
	defer arr.close()
	if rel != nil {
		done := make(chan error, 1)
		go func() { done <- rel.Run(ctx) }()
		defer func() { _ = rel.Close(); <-done }()
	}
	// A warm-up event first: the relay's start (lanes, LISTEN) and the
	// topic's first produce are not commit-to-consume latency.
	if err := b.pacedTx(ctx, topic, topic+"-warmup", 0); err != nil {
		return latencyRun{}, err
	}
	for warm := time.Now().Add(time.Minute); arr.count() == 0; {
		if time.Now().After(warm) || ctx.Err() != nil {
			return latencyRun{}, fmt.Errorf("the warm-up event did not arrive on %s within a minute", topic)
		}
		time.Sleep(20 * time.Millisecond)
	}
	commits, rate, err := b.paced(ctx, topic)
	if err != nil {
		return latencyRun{}, err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for arr.count() < len(commits)+1 {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return latencyRun{}, fmt.Errorf("%d of %d events consumed from %s", arr.count()-1, len(commits), topic)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var lat []time.Duration
	arr.mu.Lock()
	for id, c := range commits {
		lat = append(lat, arr.at[id].Sub(c))
	}
	arr.mu.Unlock()
	ms := stats.Millis(lat)
	r := latencyRun{rate: rate, p50: stats.Percentile(ms, 50), p99: stats.Percentile(ms, 99)}
	b.say("%s: %d events at %.0f/s: p50 %.1f ms, p99 %.1f ms", topic, len(commits), rate, r.p50, r.p99)
	return r, nil
}

// paced runs business transactions at cfg.Rate for cfg.Duration over the
// writers: the i-th starts at start + i/rate (at once when behind). It
// returns each event's commit time and the rate achieved.
func (b *bench) paced(ctx context.Context, topic string) (map[string]time.Time, float64, error) {
	n := int64(b.cfg.Rate) * int64(b.cfg.Duration/time.Second)
	every := time.Second / time.Duration(b.cfg.Rate)
	var next atomic.Int64
	var mu sync.Mutex
	commits := make(map[string]time.Time, n)
	errs := make(chan error, b.cfg.Writers)
	var wg sync.WaitGroup
	start := time.Now()
	for range b.cfg.Writers * 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < n; i = next.Add(1) - 1 {
				if d := time.Until(start.Add(time.Duration(i) * every)); d > 0 {
					time.Sleep(d) // pacing, not synchronisation
				}
				id := fmt.Sprintf("%s-%d", topic, i)
				if err := b.pacedTx(ctx, topic, id, i); err != nil {
					errs <- err
					return
				}
				now := time.Now()
				mu.Lock()
				commits[id] = now
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return nil, 0, err
	default:
	}
	return commits, float64(n) / time.Since(start).Seconds(), nil
}

func (b *bench) pacedTx(ctx context.Context, topic, id string, i int64) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, `INSERT INTO bench_orders (customer, total) VALUES ('c-42', 99.5)`); err != nil {
		return err
	}
	if err := outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{ID: id, Topic: topic, AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", i%drainAggregates),
		EventType: "order.placed.v1", Payload: []byte(`{"order_id":"o-42","customer":"c-42","total":99.5}`)}); err != nil {
		return err
	}
	return tx.Commit()
}
