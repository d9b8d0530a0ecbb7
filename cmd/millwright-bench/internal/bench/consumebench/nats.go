package consumebench

import (
	"context"
	"fmt"
	"math/rand"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/transport"
	tnats "github.com/millwright/millwright/transport/nats"
)

// Consumers on NATS JetStream.
const (
	ConsumerOneAtATimeNATS = "one at a time (nats)"
	ConsumerKeyedNATS      = "millwright keyed (nats)"
)

// runNATS runs the throughput scenario on NATS JetStream: for each delay,
// one stream with a durable consumer per consumer, filled by one publish;
// the subscriber one message at a time (KeyParallelism 0), then the
// keyed consumer. The failing-key scenario is Kafka's only.
func runNATS(ctx context.Context, cfg Config, rep *Report) (*Report, error) {
	b := &bench{cfg: cfg, rnd: rand.New(rand.NewSource(time.Now().UnixNano())), total: 2 * len(cfg.Delays)}
	defer b.deleteNATSStreams()
	for _, d := range cfg.Delays {
		rows, err := b.natsThroughput(ctx, d)
		rep.Rows = append(rep.Rows, rows...)
		if err != nil {
			return rep, err
		}
	}
	if cfg.FailFor > 0 {
		rep.Notes = append(rep.Notes, "one key failing: not run on nats (the scenario reads Kafka's committed offsets); run it with --kind kafka")
	}
	return rep, nil
}

func (b *bench) natsThroughput(ctx context.Context, d time.Duration) ([]Row, error) {
	n := b.cfg.messages(d)
	name := "bench_consume_" + watermill.NewShortUUID()
	groups := []string{"one-at-a-time", "keyed"}
	b.topics = append(b.topics, name)
	if err := b.publishNATS(ctx, name, n, groups); err != nil {
		return nil, err
	}
	tp := &topic{name: name, n: n}
	limit := max(200, int(baselineSeconds*time.Second/(d+time.Millisecond)))
	var rows []Row
	for i, c := range []string{ConsumerOneAtATimeNATS, ConsumerKeyedNATS} {
		r := run{consumer: c, delay: d, timeout: 5 * time.Minute}
		par := 0
		if c == ConsumerKeyedNATS {
			par = b.cfg.KeyParallelism
		} else {
			r.limit = limit
		}
		row, err := b.consumeNATS(ctx, tp, groups[i], par, r)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row)
	}
	if rows[0].Rate > 0 {
		rows[1].Ratio = rows[1].Rate / rows[0].Rate
	}
	switch d {
	case 0:
		rows[1].Target = TargetTrivial
	case 50 * time.Millisecond:
		rows[1].Target = TargetSlowHandler
	}
	return rows, nil
}

// publishNATS creates the groups' consumers, then publishes n messages
// over the keys to name.
func (b *bench) publishNATS(ctx context.Context, name string, n int, groups []string) error {
	tr, err := b.openNATS(ctx, 0)
	if err != nil {
		return err
	}
	defer tr.Close()
	for _, g := range groups {
		sub, err := tr.Subscriber(g)
		if err != nil {
			return err
		}
		if err := sub.(interface{ SubscribeInitialize(string) error }).SubscribeInitialize(name); err != nil {
			return err
		}
	}
	return b.publishKeys(tr, name, n)
}

func (b *bench) openNATS(ctx context.Context, keyParallelism int) (*transport.Transport, error) {
	c := transport.Config{Kind: transport.NATS}
	c.NATS.URL = b.cfg.NATSURL
	c.NATS.KeyParallelism = keyParallelism
	tr, err := transport.Open(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("bench consume: opening NATS: %w", err)
	}
	return tr, nil
}

// consumeNATS runs r over group's consumer of tp and returns its row.
// There is no committed position to watch: the keyed consumer acks each
// message after its handler (tested in transport/nats), so CommitSamples
// is 0.
func (b *bench) consumeNATS(ctx context.Context, tp *topic, group string, par int, r run) (Row, error) {
	tr, err := b.openNATS(ctx, par)
	if err != nil {
		return Row{}, err
	}
	defer tr.Close()
	ctx, t, stop, err := b.runRouter(ctx, tr, tp, group, r)
	if err != nil {
		return Row{}, err
	}
	defer stop()
	start := time.Now()
	select {
	case <-t.all:
	case <-ctx.Done():
		return Row{}, fmt.Errorf("bench consume: %s at %s: %w (%d of %d messages finished)", r.consumer, r.delay, ctx.Err(), t.count, t.n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	row := Row{Bench: "consume", Kind: KindNATS, Scenario: "throughput", Consumer: r.consumer, DelayMS: float64(r.delay) / float64(time.Millisecond),
		Messages: t.n, Reorders: t.reorders, Seconds: time.Since(start).Seconds(), Rate: steadyRate(t.times)}
	b.step()
	fmt.Fprintf(b.cfg.Progress, "bench consume: %s, %s handler: %.0f msg/s\n", r.consumer, r.delay, row.Rate)
	return row, nil
}

// deleteNATSStreams deletes the streams the run made.
func (b *bench) deleteNATSStreams() {
	nc, err := natsgo.Connect(b.cfg.NATSURL)
	if err != nil {
		fmt.Fprintf(b.cfg.Progress, "bench consume: cleaning up NATS: %v\n", err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return
	}
	for _, tp := range b.topics {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := js.DeleteStream(ctx, tnats.StreamName(tp)); err != nil {
			fmt.Fprintf(b.cfg.Progress, "bench consume: deleting stream %s: %v\n", tp, err)
		}
		cancel()
	}
}
