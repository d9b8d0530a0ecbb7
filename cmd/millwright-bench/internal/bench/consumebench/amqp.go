package consumebench

import (
	"context"
	"fmt"
	"math/rand"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
)

// Consumers on RabbitMQ.
const (
	ConsumerWatermillAMQP = "watermill-amqp"
	ConsumerKeyedAMQP     = "millwright keyed (amqp)"
)

// baselineSeconds bounds watermill-amqp's run: it handles one message at
// a time, so at 50 ms the whole topic would take minutes; its rate is
// read over its steady state anyway.
const baselineSeconds = 15

// runAMQP runs the throughput scenario on RabbitMQ: for each delay, one
// fanout exchange with a queue per consumer, both filled by one publish;
// watermill-amqp's subscriber, then the keyed consumer. The failing-key
// scenario is Kafka's only (a note says so).
func runAMQP(ctx context.Context, cfg Config, rep *Report) (*Report, error) {
	b := &bench{cfg: cfg, rnd: rand.New(rand.NewSource(time.Now().UnixNano())), total: 2 * len(cfg.Delays)}
	defer func() {
		if err := amqp.DeleteTopology(cfg.AMQPURL, b.topics, b.groups...); err != nil {
			fmt.Fprintf(cfg.Progress, "bench consume: cleaning up RabbitMQ: %v\n", err)
		}
	}()
	for _, d := range cfg.Delays {
		rows, err := b.amqpThroughput(ctx, d)
		rep.Rows = append(rep.Rows, rows...)
		if err != nil {
			return rep, err
		}
	}
	if cfg.FailFor > 0 {
		rep.Notes = append(rep.Notes, "one key failing: not run on amqp (the scenario reads Kafka's committed offsets); run it with --kind kafka")
	}
	return rep, nil
}

func (b *bench) amqpThroughput(ctx context.Context, d time.Duration) ([]Row, error) {
	n := b.cfg.messages(d)
	name := "bench_consume_" + watermill.NewShortUUID()
	groups := []string{"watermill", "keyed"}
	b.topics = append(b.topics, name)
	b.groups = append(b.groups, groups...)
	if err := b.publishAMQP(ctx, name, n, groups); err != nil {
		return nil, err
	}
	tp := &topic{name: name, n: n}
	limit := max(200, int(baselineSeconds*time.Second/(d+time.Millisecond)))
	var rows []Row
	for i, c := range []string{ConsumerWatermillAMQP, ConsumerKeyedAMQP} {
		r := run{consumer: c, delay: d, timeout: 5 * time.Minute}
		par := 0
		if c == ConsumerKeyedAMQP {
			par = b.cfg.KeyParallelism
		} else {
			r.limit = limit
		}
		row, err := b.consumeAMQP(ctx, tp, groups[i], par, r)
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

// publishAMQP publishes n messages over the keys to name, whose groups'
// queues the publisher declares first.
func (b *bench) publishAMQP(ctx context.Context, name string, n int, groups []string) error {
	tr, err := b.openAMQP(ctx, 0, groups)
	if err != nil {
		return err
	}
	defer tr.Close()
	return b.publishKeys(tr, name, n)
}

func (b *bench) openAMQP(ctx context.Context, keyParallelism int, declare []string) (*transport.Transport, error) {
	c := transport.Config{Kind: transport.AMQP}
	c.AMQP.URL = b.cfg.AMQPURL
	c.AMQP.KeyParallelism = keyParallelism
	c.AMQP.DeclareGroups = declare
	tr, err := transport.Open(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("bench consume: opening RabbitMQ: %w", err)
	}
	return tr, nil
}

// consumeAMQP runs r over group's queue of tp and returns its row. There
// is no committed position to watch: the keyed consumer acks each delivery
// after its handler (tested in transport/amqp), so CommitSamples is 0.
func (b *bench) consumeAMQP(ctx context.Context, tp *topic, group string, par int, r run) (Row, error) {
	tr, err := b.openAMQP(ctx, par, nil)
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
	row := Row{Bench: "consume", Kind: KindAMQP, Scenario: "throughput", Consumer: r.consumer, DelayMS: float64(r.delay) / float64(time.Millisecond),
		Messages: t.n, Reorders: t.reorders, Seconds: time.Since(start).Seconds(), Rate: steadyRate(t.times)}
	b.step()
	fmt.Fprintf(b.cfg.Progress, "bench consume: %s, %s handler: %.0f msg/s\n", r.consumer, r.delay, row.Rate)
	return row, nil
}
