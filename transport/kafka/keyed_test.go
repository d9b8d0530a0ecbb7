package kafka_test

// The key-parallel consumer (Config.KeyParallelism) on a broker: per-key
// order and no commit past an unfinished message, across a consumer
// SIGKILLed mid-batch and a rebalance (a second consumer joins, then
// leaves). Reorders and commits past unfinished messages are counted and
// must both be 0.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/keyedtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/kafka"
	"github.com/millwright/millwright/transport/transporttest"
)

// envKeyedChild makes this test binary the consumer process that
// TestKeyedConsumerKilledMidBatch kills: its JSON keyedChild.
const envKeyedChild = "MILLWRIGHT_TEST_KEYED_CHILD"

type keyedChild struct {
	Config transport.Config
	Topic  string
	Group  string
	// Block lists "key:seq" messages whose handler never returns, so the
	// partition has unfinished work below finished work when it is killed.
	Block []string
}

// ref and ledger are the shared keyed-test harness's (internal/testing/keyedtest).
type (
	ref    = keyedtest.Ref
	ledger = keyedtest.Ledger
)

// pos is where a message landed.
type pos struct {
	part int32
	off  int64
}

// keyedTopic creates a topic, publishes keys × perKey messages (payload
// "key:seq", the key as ordering key) and returns where each landed.
func keyedTopic(t *testing.T, ctx context.Context, cfg transport.Config, partitions int32, keys, perKey int) (string, map[pos]ref) {
	t.Helper()
	topic := "keyed_" + watermill.NewShortUUID()
	createTopic(t, cfg.Kafka.Brokers, topic, partitions)
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	defer tr.Close()
	var msgs []*message.Message
	for s := 0; s < perKey; s++ {
		for k := 0; k < keys; k++ {
			m := message.NewMessage(watermill.NewUUID(), []byte(ref{Key: fmt.Sprint("k", k), Seq: s}.String()))
			m.Metadata.Set(metadata.OrderingKey, fmt.Sprint("k", k))
			msgs = append(msgs, m)
		}
	}
	for i := 0; i < len(msgs); i += 500 {
		require.NoError(t, tr.Publisher().(transport.BatchPublisher).PublishBatch(topic, msgs[i:min(i+500, len(msgs))]...))
	}
	where := map[pos]ref{}
	for _, r := range readAll(ctx, t, cfg.Kafka.Brokers, topic, len(msgs)) {
		ref, ok := keyedtest.ParseRef(string(r.Value))
		require.True(t, ok, "payload %q", r.Value)
		where[pos{r.Partition, r.Offset}] = ref
	}
	return topic, where
}

// committed reads the group's committed offsets of topic from the broker.
func committed(t *testing.T, brokers []string, topic, group string, partitions int32) map[int32]int64 {
	t.Helper()
	c, err := fetchCommitted(t, brokers, topic, group, partitions)
	require.NoError(t, err)
	return c
}

func fetchCommitted(t *testing.T, brokers []string, topic, group string, partitions int32) (map[int32]int64, error) {
	admin, err := sarama.NewClusterAdmin(brokers, adminConfig(t))
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	parts := make([]int32, partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
	if err != nil {
		return nil, err
	}
	out := map[int32]int64{}
	for p, b := range resp.Blocks[topic] {
		if b.Err != sarama.ErrNoError {
			return nil, fmt.Errorf("partition %d: %w", p, b.Err)
		}
		if b.Offset >= 0 {
			out[p] = b.Offset
		}
	}
	return out, nil
}

// pastUnfinished lists the messages below a committed offset that done
// does not have.
func pastUnfinished(where map[pos]ref, commits map[int32]int64, done func(ref) bool) []string {
	var out []string
	for p, r := range where {
		if c, ok := commits[p.part]; ok && p.off < c && !done(r) {
			out = append(out, fmt.Sprintf("partition %d committed %d past unfinished offset %d (%s)", p.part, c, p.off, r))
		}
	}
	return out
}

func keyedConfig(t *testing.T, parallelism int) transport.Config {
	cfg := transporttest.Config(t, transport.Kafka)
	cfg.Kafka.KeyParallelism = parallelism
	return cfg
}

// runKeyedRouter consumes topic in group through a Watermill Router whose
// handler reports to l, sleeping d for each message (the handler's
// simulated work). It returns the router's close function.
func runKeyedRouter(t *testing.T, cfg transport.Config, topic, group string, l *ledger, d func(ref) time.Duration, handled *atomic.Int64) func() {
	t.Helper()
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddConsumerHandler("keyed", topic, sub, func(m *message.Message) error {
		ref, ok := keyedtest.ParseRef(string(m.Payload))
		if !ok {
			return fmt.Errorf("payload %q", m.Payload)
		}
		l.Start(ref)
		time.Sleep(d(ref)) // the handler's simulated work
		l.Finish(ref)
		handled.Add(1)
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	var once sync.Once
	stop := func() { once.Do(func() { _ = r.Close(); _ = tr.Close() }) }
	t.Cleanup(stop)
	return stop
}

// TestKeyedChildProcess is the consumer process of
// TestKeyedConsumerKilledMidBatch; it does nothing in a normal run.
func TestKeyedChildProcess(t *testing.T) {
	var c keyedChild
	if !keyedtest.ChildSpec(t, envKeyedChild, &c) {
		t.Skip("only as TestKeyedConsumerKilledMidBatch's child process")
	}
	tr, err := transport.Open(context.Background(), c.Config)
	require.NoError(t, err)
	sub, err := tr.Subscriber(c.Group)
	require.NoError(t, err)
	keyedtest.RunChild(t, sub, c.Topic, c.Block)
}

// TestKeyedConsumerKilledMidBatch SIGKILLs a key-parallel consumer that
// has finished messages above unfinished ones in several partitions:
// the offsets the broker has committed must not pass any message it did
// not finish, and a successor in the group gets the rest, each key in
// order.
func TestKeyedConsumerKilledMidBatch(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const partitions, keys, perKey = 4, 40, 30
	cfg := keyedConfig(t, 4)
	topic, where := keyedTopic(t, ctx, cfg, partitions, keys, perKey)
	group := "group_" + topic
	t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic, group) })

	// One blocked message per partition, early, so that most of the
	// partition finishes above it.
	var block []string
	blocked := map[int32]ref{}
	for p, r := range where {
		if r.Seq == 2 && blocked[p.part] == (ref{}) {
			blocked[p.part] = r
			block = append(block, r.String())
		}
	}
	cmd, lines, stderr := keyedtest.StartChild(t, envKeyedChild, keyedChild{Config: cfg, Topic: topic, Group: group, Block: block})
	childDone := map[ref]bool{}
	keyedtest.WaitDone(ctx, t, lines, childDone, (keys-len(block))*perKey/2, stderr)
	require.Eventually(t, func() bool {
		c, err := fetchCommitted(t, cfg.Kafka.Brokers, topic, group, partitions)
		return err == nil && len(c) == partitions
	}, 30*time.Second, 100*time.Millisecond, "every partition has a commit")

	keyedtest.Kill(t, cmd, lines, childDone)
	commits := committed(t, cfg.Kafka.Brokers, topic, group, partitions)
	t.Logf("killed after %d finished messages; committed %v; blocked %v", len(childDone), commits, blocked)

	requireFinishedAbove(t, where, blocked, childDone)
	past := pastUnfinished(where, commits, func(r ref) bool { return childDone[r] })
	require.Empty(t, past, "commits past unfinished messages: %d", len(past))

	// The successor: every message, each key in order.
	l := keyedtest.NewLedger()
	for r := range childDone {
		l.Done[r] = true
	}
	stop := runKeyedRouter(t, cfg, topic, group, l, func(ref) time.Duration { return time.Millisecond }, new(atomic.Int64))
	require.Eventually(t, func() bool { return l.Count() == len(where) }, 2*time.Minute, 50*time.Millisecond,
		"the successor finishes every message")
	stop()
	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("reorders %d, commits past unfinished %d, duplicates %d", len(l.Reorders), len(past), l.Duplicates)
	require.Empty(t, l.Reorders)
}

// requireFinishedAbove proves the fault happened: in every partition the
// blocked message is unfinished and messages above it are finished.
func requireFinishedAbove(t *testing.T, where map[pos]ref, blocked map[int32]ref, done map[ref]bool) {
	t.Helper()
	for p, r := range blocked {
		require.False(t, done[r], "blocked %s finished", r)
		above := 0
		for ps, rr := range where {
			if ps.part == p && done[rr] && ps.off > offsetOf(where, r) {
				above++
			}
		}
		require.Positive(t, above, "partition %d finished nothing above its blocked message", p)
	}
}

func offsetOf(where map[pos]ref, r ref) int64 {
	for p, rr := range where {
		if rr == r {
			return p.off
		}
	}
	return -1
}

// TestKeyedConsumerRebalance runs consumer A, lets consumer B join the
// group mid-stream, then closes B: every key stays in order across the
// two rebalances, no commit sampled meanwhile passes an unfinished
// message, and within a partition several keys run at once.
func TestKeyedConsumerRebalance(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const partitions, keys, perKey = 4, 100, 30
	cfg := keyedConfig(t, 2)
	topic, where := keyedTopic(t, ctx, cfg, partitions, keys, perKey)
	group := "group_" + topic
	t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic, group) })

	l := keyedtest.NewLedger()
	work := func(r ref) time.Duration { return time.Duration(10+(r.Seq*7+len(r.Key))%20) * time.Millisecond }
	var past []string
	var samples int
	sample := func() {
		c := committed(t, cfg.Kafka.Brokers, topic, group, partitions)
		l.Mu.Lock()
		defer l.Mu.Unlock()
		samples++
		past = append(past, pastUnfinished(where, c, func(r ref) bool { return l.Done[r] })...)
	}
	waitDone := func(n int, what string) {
		t.Helper()
		for l.Count() < n {
			sample()
			if ctx.Err() != nil {
				t.Fatalf("%s: %d of %d messages finished", what, l.Count(), n)
			}
			time.Sleep(100 * time.Millisecond) // the sampling interval
		}
	}
	var byA, byB atomic.Int64
	runKeyedRouter(t, cfg, topic, group, l, work, &byA)
	waitDone(len(where)/5, "A alone")
	stopB := runKeyedRouter(t, cfg, topic, group, l, work, &byB)
	waitDone(len(where)/2, "A and B")
	stopB()
	waitDone(len(where), "A after B left")
	sample()

	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("reorders %d, commits past unfinished %d (in %d samples), duplicates %d, most handlers at once %d, handled by A %d, by B %d",
		len(l.Reorders), len(past), samples, l.Duplicates, l.MaxActive, byA.Load(), byB.Load())
	require.Positive(t, byB.Load(), "B got partitions: the rebalance happened")
	require.Empty(t, l.Reorders)
	require.Empty(t, past)
	require.Greater(t, l.MaxActive, partitions, "keys ran in parallel within partitions")
}

// TestKeyedSlowHandlerSurvivesRebalance: a handler that takes 4 s (an
// effect outside the database, or idempotency marked after success) is
// running when a second consumer joins the group. The revoked partition
// waits for it (KeyDrainTimeout, default 30 s, with the group's rebalance
// timeout raised to cover it) instead of cancelling it and handing its
// message to the partition's next owner, which would apply the effect
// again and, with rebalances more often than the handler's duration,
// never get past it.
func TestKeyedSlowHandlerSurvivesRebalance(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const partitions, keys, perKey = 2, 8, 5
	cfg := keyedConfig(t, 4)
	topic, where := keyedTopic(t, ctx, cfg, partitions, keys, perKey)
	group := "group_" + topic
	t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic, group) })

	slow := ref{Key: "k0", Seq: 1}
	l := keyedtest.NewLedger()
	work := func(r ref) time.Duration {
		if r == slow {
			return 4 * time.Second // the handler's slow effect
		}
		return time.Millisecond
	}
	var byA, byB atomic.Int64
	runKeyedRouter(t, cfg, topic, group, l, work, &byA)
	require.Eventually(t, func() bool {
		l.Mu.Lock()
		defer l.Mu.Unlock()
		return l.Started[slow] > 0
	}, time.Minute, 5*time.Millisecond, "the slow message starts")
	runKeyedRouter(t, cfg, topic, group, l, work, &byB) // the rebalance, while it runs
	require.Eventually(t, func() bool { return l.Count() == len(where) }, 2*time.Minute, 50*time.Millisecond, "every message finishes")
	// Messages on every partition after the rebalance: B handles some,
	// which proves it joined and holds a partition.
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	defer tr.Close()
	const after = 40
	for k := 0; k < after; k++ {
		m := message.NewMessage(watermill.NewUUID(), []byte(ref{Key: fmt.Sprint("after", k), Seq: 0}.String()))
		m.Metadata.Set(metadata.OrderingKey, fmt.Sprint("after", k))
		require.NoError(t, tr.Publisher().Publish(topic, m))
	}
	require.Eventually(t, func() bool { return l.Count() == len(where)+after }, 2*time.Minute, 50*time.Millisecond, "the later messages finish")

	l.Mu.Lock()
	defer l.Mu.Unlock()
	t.Logf("slow message started %d times; reorders %d, duplicates %d, handled by A %d, by B %d", l.Started[slow], len(l.Reorders), l.Duplicates, byA.Load(), byB.Load())
	require.Positive(t, byB.Load(), "the fault: B joined and got a partition (a rebalance while the slow handler ran)")
	require.Equal(t, 1, l.Started[slow], "the slow handler was given up on at the rebalance and its message applied again")
	require.Empty(t, l.Reorders)
}

// panickingUnmarshaler panics the first time it reads the message whose
// payload is once.
type panickingUnmarshaler struct {
	kafka.Marshaler
	once     string
	panicked *atomic.Bool
}

func (u panickingUnmarshaler) Unmarshal(km *sarama.ConsumerMessage) (*message.Message, error) {
	if string(km.Value) == u.once && u.panicked.CompareAndSwap(false, true) {
		var m map[string]int
		m["boom"]++ // a runtime panic in the subscriber's own goroutine
	}
	return u.Marshaler.Unmarshal(km)
}

// TestKeyedSurvivesAPanic: reading one message panics (the first time):
// the subscriber recovers it, counts it, runs the message again in its
// key's place, and every message is handled, each key in order, by the
// same subscriber (the process and the partition go on).
func TestKeyedSurvivesAPanic(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const partitions, keys, perKey = 2, 4, 5
	cfg := keyedConfig(t, 2)
	topic, where := keyedTopic(t, ctx, cfg, partitions, keys, perKey)
	group := "group_" + topic
	t.Cleanup(func() { deleteTopic(t, cfg.Kafka.Brokers, topic, group) })
	tr, err := kafka.Open(ctx, cfg.Kafka, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	var panicked atomic.Bool
	kafka.SetKeyedUnmarshaler(sub, panickingUnmarshaler{once: "k1:2", panicked: &panicked})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	l := keyedtest.NewLedger()
	go func() {
		for m := range msgs {
			r, _ := keyedtest.ParseRef(string(m.Payload))
			go func() { // as the Router does: each message in its own goroutine
				l.Start(r)
				l.End(r, true)
				m.Ack()
			}()
		}
	}()
	l.WaitCount(t, len(where), time.Minute)
	require.True(t, panicked.Load())
	require.Equal(t, int64(1), sub.(*kafka.KeyedSubscriber).Panics(), "the fault: one panic, recovered")
	l.Mu.Lock()
	defer l.Mu.Unlock()
	require.Empty(t, l.Reorders)
	require.Equal(t, 1, l.Started[ref{Key: "k1", Seq: 2}], "the message that panicked was handed out once it read")
}
