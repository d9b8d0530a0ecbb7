package consumebench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/kafka" // the kind under test
)

// bench holds what the runs share.
type bench struct {
	cfg    Config
	rnd    interface{ Intn(int) int }
	total  int
	done   int
	topics []string
	groups []string
}

// pos is where a message landed.
type pos struct {
	part int32
	off  int64
}

// topic is a published topic: each message's key and seq (its position
// among its key's messages) by where it landed.
type topic struct {
	name  string
	where map[pos]ref
	n     int
}

type ref struct {
	key string
	seq int
}

func parseRef(p []byte) (ref, error) {
	k, s, ok := strings.Cut(string(p), ":")
	n, err := strconv.Atoi(s)
	if !ok || err != nil {
		return ref{}, fmt.Errorf("bench consume: payload %q is not key:seq", p)
	}
	return ref{k, n}, nil
}

func (b *bench) saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	sc.Admin.Timeout = 30 * time.Second
	return sc
}

// publish creates a topic and fills it with n messages over the keys,
// then reads where each landed.
func (b *bench) publish(ctx context.Context, n int) (*topic, error) {
	name := "bench_consume_" + watermill.NewShortUUID()
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, b.saramaConfig())
	if err != nil {
		return nil, fmt.Errorf("bench consume: admin client on %s: %w", strings.Join(b.cfg.Brokers, ","), err)
	}
	defer admin.Close()
	if err := admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: b.cfg.Partitions, ReplicationFactor: 1}, false); err != nil {
		return nil, fmt.Errorf("bench consume: creating topic %s: %w", name, err)
	}
	b.topics = append(b.topics, name)
	tr, err := b.open(ctx, 0)
	if err != nil {
		return nil, err
	}
	defer tr.Close()
	if err := b.publishKeys(tr, name, n); err != nil {
		return nil, err
	}
	where, err := b.readBack(ctx, name, n)
	if err != nil {
		return nil, err
	}
	return &topic{name: name, where: where, n: n}, nil
}

// publishKeys publishes n messages to name over tr, in batches of 1000,
// each with a random one of the keys as its ordering key and the key's
// sequence number in its payload ("key-3:7"), which the consumers check.
func (b *bench) publishKeys(tr *transport.Transport, name string, n int) error {
	seq := map[string]int{}
	msgs := make([]*message.Message, 0, n)
	for i := 0; i < n; i++ {
		k := "key-" + strconv.Itoa(b.rnd.Intn(b.cfg.Keys))
		m := message.NewMessage(watermill.NewUUID(), []byte(k+":"+strconv.Itoa(seq[k])))
		seq[k]++
		m.Metadata.Set(metadata.OrderingKey, k)
		m.Metadata.Set(metadata.EventID, m.UUID)
		msgs = append(msgs, m)
	}
	bp := tr.Publisher().(transport.BatchPublisher)
	for i := 0; i < n; i += 1000 {
		if err := bp.PublishBatch(name, msgs[i:min(i+1000, n)]...); err != nil {
			return fmt.Errorf("bench consume: publishing to %s: %w", name, err)
		}
	}
	return nil
}

// readBack reads every partition of name from the start, without a group.
func (b *bench) readBack(ctx context.Context, name string, n int) (map[pos]ref, error) {
	client, err := sarama.NewClient(b.cfg.Brokers, b.saramaConfig())
	if err != nil {
		return nil, fmt.Errorf("bench consume: reading %s back: %w", name, err)
	}
	defer client.Close()
	c, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("bench consume: reading %s back: %w", name, err)
	}
	defer c.Close()
	where := make(map[pos]ref, n)
	for p := int32(0); p < b.cfg.Partitions; p++ {
		hwm, err := client.GetOffset(name, p, sarama.OffsetNewest)
		if err != nil || hwm == 0 {
			continue // an empty partition (or unreadable: counted below)
		}
		if err := readPartition(ctx, c, name, p, hwm, where); err != nil {
			return nil, err
		}
	}
	if len(where) != n {
		return nil, fmt.Errorf("bench consume: read %d of the %d messages of %s back", len(where), n, name)
	}
	return where, nil
}

func readPartition(ctx context.Context, c sarama.Consumer, name string, p int32, hwm int64, where map[pos]ref) error {
	pc, err := c.ConsumePartition(name, p, sarama.OffsetOldest)
	if err != nil {
		return fmt.Errorf("bench consume: reading %s/%d back: %w", name, p, err)
	}
	defer pc.Close()
	for {
		select {
		case km := <-pc.Messages():
			r, err := parseRef(km.Value)
			if err != nil {
				return err
			}
			where[pos{p, km.Offset}] = r
			if km.Offset+1 >= hwm {
				return nil
			}
		case <-time.After(30 * time.Second):
			return fmt.Errorf("bench consume: reading %s/%d back: nothing for 30 s", name, p)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (b *bench) open(ctx context.Context, keyParallelism int) (*transport.Transport, error) {
	var c transport.Config
	c.Kind = transport.Kafka
	c.Kafka.Brokers = b.cfg.Brokers
	c.Kafka.Partitions = b.cfg.Partitions
	c.Kafka.KeyParallelism = keyParallelism
	tr, err := transport.Open(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("bench consume: opening Kafka on %s: %w", strings.Join(b.cfg.Brokers, ","), err)
	}
	return tr, nil
}

// cleanup deletes the topics and groups the runs made, leaving a shared
// broker as it was; failures are only reported on Progress.
func (b *bench) cleanup() {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, b.saramaConfig())
	if err != nil {
		fmt.Fprintf(b.cfg.Progress, "bench consume: cleaning up: %v\n", err)
		return
	}
	defer admin.Close()
	for _, g := range b.groups {
		_ = admin.DeleteConsumerGroup(g)
	}
	for _, t := range b.topics {
		if err := admin.DeleteTopic(t); err != nil {
			fmt.Fprintf(b.cfg.Progress, "bench consume: deleting topic %s: %v\n", t, err)
		}
	}
}

// tally is one run's view of what the handlers finished.
type tally struct {
	mu       sync.Mutex
	finished map[ref]bool
	acked    map[ref]bool // the outermost middleware returned nil: the consumer may commit past it
	lastSeq  map[string]int
	reorders int
	count    int         // messages finished the first time
	others   int         // of them, not of the failing key
	times    []time.Time // when each message of another key finished, in order
	all      chan struct{}
	n        int
}

func newTally(n int) *tally {
	return &tally{finished: map[ref]bool{}, acked: map[ref]bool{}, lastSeq: map[string]int{}, all: make(chan struct{}), n: n}
}

func (t *tally) ack(r ref) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.acked[r] = true
}

func (t *tally) finish(r ref, failingKey string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.finished[r] {
		return // a redelivery the idempotency middleware did not catch
	}
	if last, ok := t.lastSeq[r.key]; (ok && r.seq != last+1) || (!ok && r.seq != 0) {
		t.reorders++
	}
	t.lastSeq[r.key] = max(t.lastSeq[r.key], r.seq)
	t.finished[r] = true
	t.count++
	if r.key != failingKey {
		t.others++
		t.times = append(t.times, time.Now())
	}
	if t.count == t.n {
		close(t.all)
	}
}

// run is one consumer's run over tp.
type run struct {
	consumer   string
	delay      time.Duration
	failingKey string        // "" : none
	failUntil  time.Time     // the failing key fails until then
	wrap       bool          // KeyFailureMiddleware outermost
	timeout    time.Duration // bound on the whole run
	limit      int           // the run ends after this many messages (0: all of the topic's)
}

func (b *bench) step() {
	b.done++
	if b.cfg.Step != nil {
		b.cfg.Step(b.done, b.total)
	}
}

// consume runs r over tp and returns its row (Rate and counters).
func (b *bench) consume(ctx context.Context, tp *topic, r run) (Row, error) {
	group := tp.name + "_" + strings.ReplaceAll(r.consumer, " ", "_") + "_" + watermill.NewShortUUID()
	b.groups = append(b.groups, group)
	par := 0
	if r.consumer == ConsumerKeyed {
		par = b.cfg.KeyParallelism
	}
	tr, err := b.open(ctx, par)
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
	samples, past, err := b.watch(ctx, tp, group, t)
	if err != nil {
		return Row{}, fmt.Errorf("bench consume: %s at %s: %w (%d of %d messages finished)", r.consumer, r.delay, err, t.count, tp.n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	row := Row{Bench: "consume", Kind: KindKafka, Consumer: r.consumer, DelayMS: float64(r.delay) / float64(time.Millisecond), Messages: tp.n,
		Failing: r.failingKey != "", Reorders: t.reorders, CommitsPastUnfinished: past, CommitSamples: samples,
		Seconds: time.Since(start).Seconds()}
	row.Rate = steadyRate(t.times)
	b.step()
	fmt.Fprintf(b.cfg.Progress, "bench consume: %s, %s handler%s: %.0f msg/s\n", r.consumer, r.delay, map[bool]string{true: ", one key failing"}[r.failingKey != ""], row.Rate)
	return row, nil
}

// runRouter starts r's router over tp in group on tr, for at most
// r.timeout (the returned ctx); stop closes the router, then ends ctx.
func (b *bench) runRouter(ctx context.Context, tr *transport.Transport, tp *topic, group string, r run) (_ context.Context, _ *tally, stop func(), _ error) {
	router, t, err := b.router(tr, tp, group, r)
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	go func() { _ = router.Run(ctx) }()
	return ctx, t, func() { _ = router.Close(); cancel() }, nil
}

// steadyRate is the messages/s between the 10th and the 90th percentile
// of the finish times: the start (the group's join, the first fetches,
// a consumer filling its parallelism) and the tail (the last keys of a
// short run) would otherwise weigh on a run of a few seconds more than on
// a long one, and the two consumers' runs differ tenfold in length.
func steadyRate(times []time.Time) float64 {
	n := len(times)
	lo, hi := n/10, n-1-n/10
	if hi <= lo || !times[hi].After(times[lo]) {
		return 0
	}
	return float64(hi-lo) / times[hi].Sub(times[lo]).Seconds()
}

// router builds the run's Router: [KeyFailureMiddleware], idempotency,
// then the handler.
func (b *bench) router(tr *transport.Transport, tp *topic, group string, r run) (*message.Router, *tally, error) {
	sub, err := tr.Subscriber(group)
	if err != nil {
		return nil, nil, err
	}
	store, err := idempotency.NewPostgresStore(postgres.From(b.cfg.DB))
	if err != nil {
		return nil, nil, err
	}
	dedup, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: group})
	if err != nil {
		return nil, nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, nil, err
	}
	n := tp.n
	if r.limit > 0 {
		n = min(n, r.limit)
	}
	t := newTally(n)
	// Outermost: a message is acked (the consumer may commit past it) when
	// the whole chain returned nil: its handler ran or, with park, it was
	// parked durably.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if ref, perr := parseRef(msg.Payload); err == nil && perr == nil {
				t.ack(ref)
			}
			return out, err
		}
	})
	if r.wrap {
		mw, err := KeyFailureMiddleware()
		if err != nil {
			return nil, nil, fmt.Errorf("bench consume: KeyFailureMiddleware: %w", err)
		}
		router.AddMiddleware(mw)
	}
	router.AddMiddleware(dedup.Middleware)
	sleep := ""
	if r.delay > 0 {
		sleep = fmt.Sprintf("SELECT pg_sleep(%.6f)", r.delay.Seconds())
	}
	router.AddConsumerHandler("bench", tp.name, sub, func(msg *message.Message) error {
		ref, err := parseRef(msg.Payload)
		if err != nil {
			return err
		}
		if ref.key == r.failingKey && time.Now().Before(r.failUntil) {
			return errors.New("bench consume: the failing key's simulated transient failure")
		}
		if sleep != "" {
			pt, ok := idempotency.TxFromContext(msg.Context())
			tx := pt.SQL()
			if !ok {
				return errors.New("bench consume: no idempotency transaction in the message context")
			}
			if _, err := tx.ExecContext(msg.Context(), sleep); err != nil {
				return err
			}
		}
		t.finish(ref, r.failingKey)
		return nil
	})
	return router, t, nil
}

// watch waits for every message to finish, reading the group's committed
// offsets every 250 ms and counting the messages below them that were
// not finished yet.
func (b *bench) watch(ctx context.Context, tp *topic, group string, t *tally) (samples, past int, err error) {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, b.saramaConfig())
	if err != nil {
		return 0, 0, err
	}
	defer admin.Close()
	parts := make([]int32, b.cfg.Partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	sample := func() error {
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{tp.name: parts})
		if err != nil {
			return fmt.Errorf("reading the committed offsets of group %s: %w", group, err)
		}
		t.mu.Lock()
		defer t.mu.Unlock()
		samples++
		for p, r := range tp.where {
			if blk := resp.GetBlock(tp.name, p.part); blk != nil && blk.Offset > p.off && !t.acked[r] {
				past++
			}
		}
		return nil
	}
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-t.all:
			// Let the last marks reach the broker (auto-commit: 1 s).
			time.Sleep(1500 * time.Millisecond)
			return samples, past, sample()
		case <-tick.C:
			if err := sample(); err != nil {
				return samples, past, err
			}
		case <-ctx.Done():
			return samples, past, ctx.Err()
		}
	}
}
