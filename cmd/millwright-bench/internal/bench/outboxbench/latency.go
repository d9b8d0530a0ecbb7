package outboxbench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

// SQLConsumerPoll is the poll interval of the sql kind's consumer in the
// benchmark: its fallback, since a NOTIFY wakes it (Config.SQL.ListenURL).
const SQLConsumerPoll = time.Second

// benchLatency measures commit-to-consumer latency through the relay
// (LISTEN and a 1 s poll fallback) and through Watermill's forwarder at its
// default poll and at a 10 ms poll, runs interleaved round by round.
func (b *bench) benchLatency(ctx context.Context, kind string, t *transport.Transport) error {
	if _, err := b.DB.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	type variant struct {
		name    string
		start   func(round int) (write writeFunc, start startFunc)
		p50s    []float64
		p99s    []float64
		spans   *spanLog
		samples []sample
	}
	spans := newSpanLog()
	variants := []*variant{
		{name: "outbox relay, LISTEN + 1s poll", spans: spans, start: func(int) (writeFunc, startFunc) { return b.relayLatency(ctx, t, spans) }},
		{name: "watermill forwarder (defaults, 1s poll)", start: func(round int) (writeFunc, startFunc) { return b.forwarderLatency(ctx, t, round, 0) }},
		{name: "watermill forwarder, 10ms poll", start: func(round int) (writeFunc, startFunc) {
			return b.forwarderLatency(ctx, t, round, 10*time.Millisecond)
		}},
	}
	if b.NoForwarders {
		variants = variants[:1]
	}
	var horizon *horizonSampler
	var (
		latePs  []float64 // per relay run: p99 oversleep of a 1 ms sleep
		lateMax float64
	)
	for round := range b.Rounds {
		for i, v := range variants {
			if kind == "sql" && i == 0 && round == 0 {
				var err error
				if horizon, err = startHorizonSampler(ctx, b.DB); err != nil {
					return err
				}
			}
			write, start := v.start(round)
			var probe *lateness
			if i == 0 {
				probe = startLateness()
			}
			xs, err := b.latencyRun(ctx, t, fmt.Sprintf("bench_outbox_latency_%d_%d", time.Now().UnixNano(), round), write, start, v.spans)
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			if probe != nil {
				p, w := probe.result()
				latePs, lateMax = append(latePs, p), max(lateMax, w)
			}
			p50, p99 := percentiles(xs)
			v.p50s, v.p99s = append(v.p50s, p50), append(v.p99s, p99)
			v.samples = append(v.samples, xs...)
			if horizon != nil && i == 0 {
				b.horizonRows = append(b.horizonRows, horizon.rows(kind)...)
				horizon = nil
			}
		}
	}
	consumer := ""
	if kind == "sql" {
		consumer = fmt.Sprintf(" (consumer woken by NOTIFY, polls every %s as fallback)", SQLConsumerPoll)
	}
	var fwd float64
	if len(variants) > 2 {
		fwd = median(variants[2].p99s) // the forwarder at a 10 ms poll
	}
	for i, v := range variants {
		b.emit(Row{Case: "latency " + kind, Variant: fmt.Sprintf("%s: commit to consumer p50 at %d/s%s", v.name, b.Rate, consumer), Value: median(v.p50s), Unit: "ms", Runs: v.p50s})
		row := Row{Case: "latency " + kind, Variant: fmt.Sprintf("%s: commit to consumer p99 at %d/s%s", v.name, b.Rate, consumer), Value: median(v.p99s), Unit: "ms", Runs: v.p99s}
		if i == 0 {
			row.Target = "<= 25 ms"
			if fwd > 0 {
				row.VsForwarder = row.Value / fwd
			}
		}
		b.emit(row)
	}
	b.emit(Row{Case: "latency " + kind, Unit: "ms", Value: median(latePs), Runs: latePs,
		Variant: fmt.Sprintf("machine during the relay runs: a 1 ms sleep overslept by p99 (worst %.0f ms)", lateMax)})
	for _, r := range b.horizonRows {
		b.emit(r)
	}
	b.horizonRows = nil
	// Where the relay's tail comes from (all rounds together).
	a := attribute(variants[0].samples)
	for i, name := range stageNames {
		b.emit(Row{Case: "latency " + kind, Variant: fmt.Sprintf("outbox relay p99 tail (%d slowest events): %s; that stage's own p99 %.1f ms", a.tailN, name, a.p99[i]),
			Value: a.tailMean[i], Unit: "ms mean"})
	}
	return nil
}

// percentiles returns the p50 and p99 of the samples' totals, in ms.
func percentiles(xs []sample) (p50, p99 float64) {
	d := make([]time.Duration, len(xs))
	for i, s := range xs {
		d[i] = s.total()
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return ms(d[len(d)/2]), ms(d[len(d)*99/100])
}

// writeFunc writes one event in tx; startFunc starts the relaying side.
type (
	writeFunc func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error
	startFunc func() (stop func(), err error)
)

// relayLatency: outbox.Add in the transaction, a relay with LISTEN and a
// 1 s poll fallback.
func (b *bench) relayLatency(ctx context.Context, t *transport.Transport, spans *spanLog) (writeFunc, startFunc) {
	write := func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error {
		return outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{ID: id, Topic: topic, AggregateType: "order", AggregateID: agg, Payload: b.payload})
	}
	start := func() (func(), error) {
		r, err := relay.New(postgres.From(b.DB), t.Publisher(), relay.Config{ListenURL: b.URL, PollInterval: time.Second,
			TracerProvider: spans.provider()})
		if err != nil {
			return nil, err
		}
		done := make(chan struct{})
		go func() { defer close(done); _ = r.Run(ctx) }()
		<-r.Running()
		return func() { _ = r.Close(); <-done }, nil
	}
	return write, start
}

// forwarderLatency: forwarder.NewPublisher over a watermill-sql publisher
// on the transaction, forwarder.NewForwarder over a watermill-sql
// subscriber polling every poll (0: its default, 1 s).
func (b *bench) forwarderLatency(ctx context.Context, t *transport.Transport, round int, poll time.Duration) (writeFunc, startFunc) {
	fwdTopic := fmt.Sprintf("bench_fwd_latency_%d_%d", time.Now().UnixNano(), round)
	write := func(ctx context.Context, tx *sql.Tx, topic, id, agg string) error {
		sp, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		m := message.NewMessage(id, b.payload)
		m.Metadata.Set(transport.OrderingKey, agg)
		return forwarder.NewPublisher(sp, forwarder.PublisherConfig{ForwarderTopic: fwdTopic}).Publish(topic, m)
	}
	start := func() (func(), error) {
		sub, err := wsql.NewSubscriber(b.DB, wsql.SubscriberConfig{
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
			PollInterval: poll,
		}, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		// The forwarder topic's table, created outside the writers'
		// transactions.
		if err := sub.SubscribeInitialize(fwdTopic); err != nil {
			_ = sub.Close()
			return nil, err
		}
		fwd, err := forwarder.NewForwarder(sub, t.Publisher(), watermill.NopLogger{}, forwarder.Config{ForwarderTopic: fwdTopic})
		if err != nil {
			_ = sub.Close()
			return nil, err
		}
		done := make(chan struct{})
		go func() { defer close(done); _ = fwd.Run(ctx) }()
		<-fwd.Running()
		return func() { _ = fwd.Close(); <-done; _ = sub.Close() }, nil
	}
	return write, start
}

// latencyRun writes events at rate per second for d, each in its own
// transaction through write, while the relaying side started by start
// forwards them to topic on t, and returns each event's commit (Commit's
// return), receipt by the consumer and, from spans (nil: none), the
// relay's publish span.
func (b *bench) latencyRun(ctx context.Context, t *transport.Transport, topic string, write writeFunc, start startFunc, spans *spanLog) ([]sample, error) {
	rate, d := b.Rate, b.LatencyDuration
	b.topics = append(b.topics, topic)
	sub, err := t.Subscriber(b.Group)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := sub.Subscribe(sctx, topic)
	if err != nil {
		return nil, err
	}
	var committed sync.Map // event ids written
	var mu sync.Mutex
	received := map[string]time.Time{}
	commitDone := map[string]time.Time{}
	warm := make(chan struct{}, 1)
	go func() {
		for m := range ch {
			now := time.Now()
			if _, ok := committed.Load(m.UUID); ok {
				mu.Lock()
				received[m.UUID] = now
				mu.Unlock()
			} else {
				select {
				case warm <- struct{}{}:
				default:
				}
			}
			m.Ack()
		}
	}()
	stop, err := start()
	if err != nil {
		return nil, err
	}
	defer stop()
	writeOne := func(id, agg string) error {
		tx, err := b.DB.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := write(ctx, tx, topic, id, agg); err != nil {
			tx.Rollback() //nolint:errcheck
			return err
		}
		return tx.Commit()
	}
	// Warm up until the subscriber receives (consumer group joins).
	warmDeadline := time.Now().Add(60 * time.Second)
warmup:
	for {
		if err := writeOne(watermill.NewUUID(), "warmup"); err != nil {
			return nil, err
		}
		select {
		case <-warm:
			break warmup
		case <-time.After(time.Second):
			if time.Now().After(warmDeadline) {
				return nil, errors.New("subscriber received nothing within 60s")
			}
		}
	}
	interval := time.Second / time.Duration(rate)
	total := int(d / interval)
	tick := time.NewTicker(interval)
	for i := range total {
		<-tick.C
		id := watermill.NewUUID()
		// Marked known before COMMIT (the event may arrive before Commit
		// returns); latency counts from Commit's return, 0 for an event
		// that arrived earlier.
		committed.Store(id, true)
		if err := writeOne(id, strconv.Itoa(i%100)); err != nil {
			tick.Stop()
			return nil, err
		}
		mu.Lock()
		commitDone[id] = time.Now()
		mu.Unlock()
	}
	tick.Stop()
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		got := len(received)
		mu.Unlock()
		if got >= total || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(received) < total {
		return nil, fmt.Errorf("received %d of %d events within 30s", len(received), total)
	}
	return samples(received, commitDone, spans), nil
}

// samples joins each received event's commit, receipt and (spans not nil)
// relay publish span.
func samples(received, commitDone map[string]time.Time, spans *spanLog) []sample {
	xs := make([]sample, 0, len(received))
	for id, at := range received {
		s := sample{commit: commitDone[id], received: at}
		if spans != nil {
			spans.mu.Lock()
			s.pubStart, s.pubEnd = spans.start[id], spans.end[id]
			spans.mu.Unlock()
		}
		xs = append(xs, s)
	}
	return xs
}
