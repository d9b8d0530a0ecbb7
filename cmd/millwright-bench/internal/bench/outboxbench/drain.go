package outboxbench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

// drainBatch is the batch size of the relays and of the bare loops: the
// relay's default.
const drainBatch = 500

// drainVariant is one way of draining the backlog with n workers.
type drainVariant struct {
	name string
	n    int
	run  func(n int) error
}

// benchDrain measures the time to publish a backlog of Backlog events with
// N relays and N bare loops for each N of Relays, runs interleaved round
// by round, beside Watermill's forwarder and the publisher alone.
func (b *bench) benchDrain(ctx context.Context, kind string, t *transport.Transport) error {
	pub := t.Publisher()
	n := b.Backlog
	// The bare loop's own index: it claims the oldest pending rows, which
	// the outbox's lane index does not order (migration 004 dropped the
	// outbox's plain pending index). A hand-written relay would bring one.
	// Built before the timed runs; the relays' marks add no entry to it
	// (published rows are outside its predicate).
	if _, err := b.DB.ExecContext(ctx, `CREATE INDEX IF NOT EXISTS bench_outbox_bare_pending_idx ON millwright_outbox (id) WHERE status = 'pending'`); err != nil {
		return fmt.Errorf("creating the bare loop's index: %w", err)
	}
	defer func() {
		_, _ = b.DB.ExecContext(context.WithoutCancel(ctx), `DROP INDEX IF EXISTS bench_outbox_bare_pending_idx`)
	}()
	// A topic per run: on a real broker an earlier run's would still hold
	// its events.
	topic := fmt.Sprintf("bench_outbox_drain_%d", time.Now().UnixNano())
	b.topics = append(b.topics, topic)
	var variants []drainVariant
	for _, k := range b.Relays {
		variants = append(variants,
			drainVariant{fmt.Sprintf("bare loop x%d", k), k, func(k int) error { return b.bareLoops(ctx, pub, k) }},
			drainVariant{fmt.Sprintf("outbox relay x%d", k), k, func(k int) error { return b.relays(ctx, pub, k) }})
	}
	// Autovacuum would clean the dead rows of each run's marks at a time
	// of its own (its naptime is a minute), inside one run or another;
	// the next fill's TRUNCATE removes them anyway.
	if err := autovacuumOff(ctx, b.DB); err != nil {
		return err
	}
	// One untimed run first: the first run of a section pays the cold
	// start (the pool's connections, the broker's topic and partitions,
	// a small heap the collector scans over and over), which fell on the
	// first variant of round 0 alone (a fifth slower than the same
	// variant's later runs, here).
	if err := b.fill(ctx, topic, n); err != nil {
		return err
	}
	warm := variants[len(variants)-1]
	if err := warm.run(warm.n); err != nil {
		return fmt.Errorf("warm-up (%s): %w", warm.name, err)
	}
	results := make([][]float64, len(variants))
	var fwds, alone []float64
	fwdFailed := false
	for round := range b.Rounds {
		for _, i := range roundOrder(len(variants), round) {
			v := variants[i]
			if err := b.fill(ctx, topic, n); err != nil {
				return err
			}
			start := time.Now()
			if err := v.run(v.n); err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			results[i] = append(results[i], float64(n)/time.Since(start).Seconds())
		}
		// A forwarder that cannot drain the backlog in time (Watermill's
		// reads every remaining row per poll) costs its own row, not the
		// relays' and bare loops' measured already; later rounds skip it.
		if !fwdFailed {
			switch rate, err := b.forwarderDrain(ctx, pub, fmt.Sprintf("bench_fwd_%d_%d", time.Now().UnixNano(), round), topic, b.forwarderBacklog()); {
			case err == nil:
				fwds = append(fwds, rate)
			case ctx.Err() != nil:
				return fmt.Errorf("watermill forwarder: %w", err)
			default:
				fwdFailed, fwds = true, nil
				b.Progress("drain via %s: watermill forwarder: %v (its row says so; the other rows stand)", kind, err)
				b.emit(Row{Case: "drain " + kind, Variant: "watermill forwarder", Unit: "-", NotRun: err.Error()})
			}
		}
		rate, err := b.publisherAlone(pub, topic, n)
		if err != nil {
			return fmt.Errorf("watermill publisher alone: %w", err)
		}
		alone = append(alone, rate)
	}
	b.emitDrain(kind, pub, variants, results, fwds, alone)
	return nil
}

// roundOrder is the order of the variants in a round: as listed (by N,
// each bare loop before its relays) in even rounds, reversed in odd ones.
// So neither of a bare loop and relay pair always runs right after the
// other (on whatever the one before left behind: dirty pages, a broker's
// backlog, a warm cache), and neither do N and N-1 relays: the machine
// drifts within a round too (the process's heap grows with an embedded
// broker's topic, and the collector runs less often), and a fixed order
// by N would give that drift to the "vs fewer" ratios.
func roundOrder(n, round int) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
		if round%2 == 1 {
			order[i] = n - 1 - i
		}
	}
	return order
}

// pairedRatio is the median over the rounds of a's run over b's run of the
// same round. On a shared machine the rate of every variant drifts by
// tens of percent over minutes, together; within a round the runs are
// seconds apart, so the round's ratio keeps little of that drift, where
// the ratio of two medians, taken from different rounds, keeps it all.
func pairedRatio(a, b []float64) float64 {
	ratios := make([]float64, 0, len(a))
	for r := range min(len(a), len(b)) {
		if b[r] > 0 {
			ratios = append(ratios, a[r]/b[r])
		}
	}
	return median(ratios)
}

// forwarderDrainMax caps the forwarder's backlog: it publishes one event
// at a time, at a rate a larger backlog does not change, and at a few
// thousand events/s a backlog the relays need to run long enough to
// measure would keep it busy for minutes a round.
const forwarderDrainMax = 100_000

func (b *bench) forwarderBacklog() int { return min(b.Backlog, forwarderDrainMax) }

// emitDrain prints the drain rows: each relay row against the bare loops
// at its N (baseline) and the relays at the N before (vs fewer), each
// ratio the median of the rounds' own ratios (pairedRatio).
func (b *bench) emitDrain(kind string, pub message.Publisher, variants []drainVariant, results [][]float64, fwds, alone []float64) {
	fwd, pubRate := median(fwds), median(alone)
	call := "Publish"
	if _, ok := pub.(transport.BatchPublisher); ok {
		call = "PublishBatch"
	}
	hot := ""
	if b.HotPercent > 0 {
		hot = fmt.Sprintf(", %d%% on one", b.HotPercent)
	}
	suffix := fmt.Sprintf(", batch %d, %d events over %d aggregates%s (%s)", drainBatch, b.Backlog, b.Aggregates, hot, call)
	bare, fewer := -1, -1 // indexes of the bare loops at N and the relays at the N before
	for i, v := range variants {
		row := Row{Case: "drain " + kind, Variant: v.name + suffix, Value: median(results[i]), Unit: "events/s", Runs: results[i],
			VsPublisher: median(results[i]) / pubRate}
		if fwd > 0 {
			row.VsForwarder = row.Value / fwd
		}
		if strings.HasPrefix(v.name, "bare") {
			bare = i
		} else {
			row.Baseline, row.Ratio = median(results[bare]), pairedRatio(results[i], results[bare])
			row.Target = ">= 0.90x bare"
			if v.n == 1 {
				row.Target = ">= 0.95x bare"
			}
			if fewer >= 0 {
				row.VsFewer = pairedRatio(results[i], results[fewer])
				row.Target += ", >= 1.00x fewer"
			}
			fewer = i
		}
		b.emit(row)
	}
	if len(fwds) > 0 {
		b.emit(Row{Case: "drain " + kind, Variant: fmt.Sprintf("watermill forwarder + watermill-sql (defaults), %d events", b.forwarderBacklog()),
			Value: fwd, Unit: "events/s", VsPublisher: fwd / pubRate, Runs: fwds})
	}
	b.emit(Row{Case: "drain " + kind, Variant: fmt.Sprintf("watermill publisher alone, no database (Publish, 100 per call, 8 goroutines), %d events", b.Backlog),
		Value: pubRate, Unit: "events/s", Runs: alone})
}

// relays drains the backlog with k relays at their defaults, started
// together (each is built first: the clock times the drain, not relay.New).
func (b *bench) relays(ctx context.Context, pub message.Publisher, k int) error {
	var rs []*relay.Relay
	for range k {
		r, err := relay.New(postgres.From(b.DB), pub, relay.Config{BatchSize: drainBatch})
		if err != nil {
			return err
		}
		rs = append(rs, r)
	}
	var wg sync.WaitGroup
	for _, r := range rs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = r.Run(ctx) }()
	}
	err := b.waitDrained(ctx, rs, 5*time.Minute)
	for _, r := range rs {
		_ = r.Close()
	}
	wg.Wait()
	return err
}

// bareLoops drains the backlog with k bare loops at once.
func (b *bench) bareLoops(ctx context.Context, pub message.Publisher, k int) error {
	errs := make(chan error, k)
	for range k {
		go func() { errs <- bareLoop(ctx, b.DB, pub) }()
	}
	var all []error
	for range k {
		all = append(all, <-errs)
	}
	return errors.Join(all...)
}

// bareLoop is the hand-written relay the relay is measured against, made
// fair: the relay's batch size, one transaction per batch held across the
// publish (FOR UPDATE SKIP LOCKED keeps concurrent loops apart), each row
// to its own topic (one call per topic, PublishBatch when the publisher
// has it), the same message as the relay's (its CloudEvents metadata:
// nine headers instead of one cost an in-process broker most of its
// time), marked with the relay's one-round-trip UPDATE ... WHERE id =
// ANY(literal). It keeps no order across loops, no lease, no metrics.
func bareLoop(ctx context.Context, db *sql.DB, pub message.Publisher) error {
	for {
		done, err := bareBatch(ctx, db, pub)
		if err != nil || done {
			return err
		}
	}
}

func bareBatch(ctx context.Context, db *sql.DB, pub message.Publisher) (done bool, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	rows, err := tx.QueryContext(ctx, `SELECT id, event_id, topic, aggregate_type, aggregate_id, event_type, created_at, payload::text FROM millwright_outbox
		WHERE status = 'pending' ORDER BY id LIMIT `+strconv.Itoa(drainBatch)+` FOR UPDATE SKIP LOCKED`)
	if err != nil {
		return false, err
	}
	var ids strings.Builder
	var topics []string
	byTopic := map[string][]*message.Message{}
	for rows.Next() {
		var id int64
		var eid, topic, aggType, agg, eventType, p string
		var created time.Time
		if err := rows.Scan(&id, &eid, &topic, &aggType, &agg, &eventType, &created, &p); err != nil {
			rows.Close()
			return false, err
		}
		m := message.NewMessage(eid, []byte(p))
		m.Metadata = message.Metadata{metadata.EventID: eid, metadata.EventSpecVersion: "1.0", metadata.EventTime: created.UTC().Format(time.RFC3339Nano),
			metadata.EventSubject: agg, metadata.AggregateID: agg, metadata.AggregateType: aggType, metadata.OrderingKey: aggType + "/" + agg,
			metadata.EventType: eventType, metadata.EventDataContentType: "application/json"}
		if _, ok := byTopic[topic]; !ok {
			topics = append(topics, topic)
		}
		byTopic[topic] = append(byTopic[topic], m)
		if ids.Len() > 0 {
			ids.WriteByte(',')
		}
		ids.WriteString(strconv.FormatInt(id, 10))
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return false, err
	}
	if ids.Len() == 0 {
		return true, tx.Commit()
	}
	bp, batched := pub.(transport.BatchPublisher)
	for _, topic := range topics {
		if batched {
			err = bp.PublishBatch(topic, byTopic[topic]...)
		} else {
			err = pub.Publish(topic, byTopic[topic]...)
		}
		if err != nil {
			return false, err
		}
	}
	if _, err := tx.ExecContext(ctx, `UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE id = ANY('{`+ids.String()+`}'::bigint[])`); err != nil {
		return false, err
	}
	return false, tx.Commit()
}

// fill truncates the outbox and writes n events over Aggregates
// aggregates, HotPercent of them (the first of every hundred) on one more.
func (b *bench) fill(ctx context.Context, topic string, n int) error {
	if _, err := b.DB.ExecContext(ctx, `TRUNCATE millwright_outbox`); err != nil {
		return err
	}
	evs := make([]outbox.Event, 0, 1000)
	for i := 0; i < n; i++ {
		agg := strconv.Itoa(i % b.Aggregates)
		if i%100 < b.HotPercent {
			agg = "hot"
		}
		evs = append(evs, outbox.Event{Topic: topic, AggregateType: "order", AggregateID: agg, EventType: "order.created.v1", Payload: b.payload})
		if len(evs) == cap(evs) || i == n-1 {
			if err := outbox.AddOutsideTx(ctx, postgres.From(b.DB), evs...); err != nil {
				return err
			}
			evs = evs[:0]
		}
	}
	if _, err := b.DB.ExecContext(ctx, `ANALYZE millwright_outbox`); err != nil {
		return err
	}
	// The fill's pages go to disk now, not in a checkpoint that falls in
	// whichever run is timed when it comes (a run writes 200-300 MB of
	// WAL: every few runs cross max_wal_size). Without the right to
	// CHECKPOINT (superuser or pg_checkpoint) the runs go on without it,
	// and the bench stops asking.
	if b.noCheckpoint {
		return nil
	}
	if _, err := b.DB.ExecContext(ctx, `CHECKPOINT`); err != nil {
		if ctx.Err() != nil {
			return err
		}
		b.noCheckpoint = true
		b.Progress("drain: CHECKPOINT before each run refused (%v): checkpoints may fall inside timed runs", err)
	}
	return nil
}

// waitDrained waits until the relays rs have marked the whole backlog, by
// their own counters (Relay.Stats), then confirms in the database that
// nothing is pending. Polling the table instead, every 10 ms, took a
// fifth of a core from Postgres while the relays ran (2-3 ms a probe
// through the index entries of the rows they had just marked): a cost the
// bare loops, which stop on an empty claim, never paid.
func (b *bench) waitDrained(ctx context.Context, rs []*relay.Relay, timeout time.Duration) error {
	start := time.Now()
	deadline := start.Add(timeout)
	// Each relay's share of the drain, for the progress log: when it
	// first and last published and how much.
	first, last := make([]time.Duration, len(rs)), make([]time.Duration, len(rs))
	counts := make([]uint64, len(rs))
	for {
		var published uint64
		for i, r := range rs {
			c := r.Stats().Published
			if c != counts[i] {
				if counts[i] == 0 {
					first[i] = time.Since(start)
				}
				counts[i], last[i] = c, time.Since(start)
			}
			published += c
		}
		if published >= uint64(b.Backlog) {
			var pending bool
			if err := b.DB.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM millwright_outbox WHERE status = 'pending')`).Scan(&pending); err != nil {
				return err
			}
			if !pending {
				if len(rs) > 1 {
					var shares []string
					for i := range rs {
						shares = append(shares, fmt.Sprintf("%d events from %v to %v", counts[i], first[i].Round(time.Millisecond), last[i].Round(time.Millisecond)))
					}
					b.Progress("%d relays drained in %v: %s", len(rs), time.Since(start).Round(time.Millisecond), strings.Join(shares, "; "))
				}
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not drained after %s (%d of %d marked published)", timeout, published, b.Backlog)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
}

// publisherAlone measures the transport's Watermill publisher with no
// database in the way: n messages shaped like the relay's (same payload,
// the CloudEvents metadata the relay sends), with Publish (never
// PublishBatch), 100 messages per call from 8 goroutines. It is the "what
// Watermill's own publisher reaches on that broker" the relay is compared
// with.
func (b *bench) publisherAlone(pub message.Publisher, topic string, n int) (float64, error) {
	msgs := make([]*message.Message, n)
	now := time.Now().UTC().Format(time.RFC3339Nano)
	for i := range msgs {
		id := watermill.NewUUID()
		agg := "a-" + strconv.Itoa(i%b.Aggregates)
		m := message.NewMessage(id, b.payload)
		for k, v := range map[string]string{metadata.EventID: id, metadata.EventSpecVersion: "1.0", metadata.EventTime: now,
			metadata.EventSubject: agg, metadata.AggregateID: agg, metadata.AggregateType: "bench", metadata.OrderingKey: "bench/" + agg,
			metadata.EventType: "bench.event.v1", metadata.EventDataContentType: "application/json"} {
			m.Metadata.Set(k, v)
		}
		msgs[i] = m
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	start := time.Now()
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				from := int(next.Add(100)) - 100
				if from >= n {
					return
				}
				if err := pub.Publish(topic, msgs[from:min(from+100, n)]...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// countingPublisher counts what the forwarder sends and signals when n
// messages went out.
type countingPublisher struct {
	message.Publisher
	n    int64
	sent atomic.Int64
	done chan struct{}
	once sync.Once
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if p.sent.Add(int64(len(msgs))) >= p.n {
		p.once.Do(func() { close(p.done) })
	}
	return nil
}

// forwarderDrain measures Watermill's own outbox on the same backlog:
// events written through forwarder.NewPublisher over watermill-sql, then
// forwarded to pub by forwarder.NewForwarder with its defaults.
func (b *bench) forwarderDrain(ctx context.Context, pub message.Publisher, fwdTopic, topic string, n int) (float64, error) {
	logger := watermill.NopLogger{}
	sqlPub, err := wsql.NewPublisher(b.DB, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		return 0, err
	}
	fwdPub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
	for i := 0; i < n; i += 1000 {
		msgs := make([]*message.Message, 0, 1000)
		for j := i; j < min(i+1000, n); j++ {
			m := message.NewMessage(watermill.NewUUID(), b.payload)
			m.Metadata.Set(transport.OrderingKey, strconv.Itoa(j%1000))
			msgs = append(msgs, m)
		}
		if err := fwdPub.Publish(topic, msgs...); err != nil {
			return 0, err
		}
	}
	sub, err := wsql.NewSubscriber(b.DB, wsql.SubscriberConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		return 0, err
	}
	out := &countingPublisher{Publisher: pub, n: int64(n), done: make(chan struct{})}
	fwd, err := forwarder.NewForwarder(sub, out, logger, forwarder.Config{ForwarderTopic: fwdTopic})
	if err != nil {
		return 0, err
	}
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- fwd.Run(ctx) }()
	// Stopped on every path: one left running after a timeout would keep
	// publishing while the next rounds are measured.
	defer func() { _ = fwd.Close(); _ = sub.Close() }()
	select {
	case <-out.done:
	case err := <-errc:
		return 0, fmt.Errorf("forwarder stopped: %v", err)
	case <-time.After(5 * time.Minute):
		return 0, errors.New("forwarder did not drain within 5 minutes")
	}
	rate := float64(n) / time.Since(start).Seconds()
	return rate, nil
}
