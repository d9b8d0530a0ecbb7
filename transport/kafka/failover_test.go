package kafka

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// EnvTestKafkaCluster names the three-broker cluster of
// `scripts/services.sh cluster up` (its bootstrap brokers, comma
// separated). EnvTestRequireKafkaCluster=1 (CI's failover stage) fails
// the cluster tests instead of skipping them when it is unset.
const (
	EnvTestKafkaCluster        = "MILLWRIGHT_TEST_KAFKA_CLUSTER"
	EnvTestRequireKafkaCluster = "MILLWRIGHT_TEST_REQUIRE_KAFKA_CLUSTER"
)

// clusterBrokers is the cluster's bootstrap brokers, or the test is
// skipped (failed under EnvTestRequireKafkaCluster).
func clusterBrokers(t *testing.T) []string {
	t.Helper()
	v := os.Getenv(EnvTestKafkaCluster)
	if v == "" {
		if os.Getenv(EnvTestRequireKafkaCluster) == "1" {
			t.Fatalf("%s=1 but %s is unset: start the cluster with eval \"$(scripts/services.sh cluster up)\"", EnvTestRequireKafkaCluster, EnvTestKafkaCluster)
		}
		t.Skipf("needs the three-broker Kafka cluster: eval \"$(scripts/services.sh cluster up)\" sets %s", EnvTestKafkaCluster)
	}
	return strings.Split(v, ",")
}

// Failover test sizes: 100,000 events over 1,000 aggregates, on a topic
// of 12 partitions (the consumers' parallelism: one handler at a time per
// partition, each a Postgres transaction).
const (
	foAggregates = 1000
	foPerAgg     = 100
	foTotal      = foAggregates * foPerAgg
	foPartitions = 12
	foRelays     = 3
	// foStallBound is the longest a kill may stall the relays' publishes
	// to the killed partition: the controller fences the dead node after
	// 3 s (broker.session.timeout.ms of the test cluster), the relay's
	// retry backoff is at most 1 s here.
	foStallBound = 30 * time.Second
)

type foEvent struct {
	Agg string `json:"agg"`
	Seq int    `json:"seq"`
}

// TestLeaderFailoverUnderLoad relays 100,000 outbox events of 1,000
// aggregates through three relays to a three-broker cluster (RF 3,
// min.insync.replicas=2) while two consumers in one group apply them
// through the idempotency middleware (the effect and the mark in one
// Postgres transaction). The leader of the busiest partition is SIGKILLed
// twice mid-drain (the script's kill-leader), each time restarted
// (start-broker) after the drain moved on. At the end: every event's
// effect is applied exactly once (0 lost, 0 duplicate effects), each
// aggregate's effects are in outbox order (what the deduplicating
// consumer applied first), and each kill's stall of the relays'
// publishes to that partition is bounded. Each kill is proven: the
// script's pid is gone and the partition's leader moved.
func TestLeaderFailoverUnderLoad(t *testing.T) {
	brokers := clusterBrokers(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	f := setupFailover(ctx, t, brokers)

	// The backlog is written in two halves, one kill each: a killed broker
	// takes a minute or more to restart and rejoin the ISR on the loaded
	// 2-core machine, so the second kill waits for the first broker's
	// return and for the second half, and still falls mid-drain.
	start := time.Now()
	f.startRelays(ctx, t)
	var kills []killReport
	for i := range 2 {
		first := i*foPerAgg/2 + 1
		f.writeBacklog(ctx, t, first, first+foPerAgg/2-1)
		f.waitPublished(ctx, t, int64(i*foTotal/2+foTotal/10))
		k := f.killLeader(ctx, t)
		f.restart(ctx, t, &k)
		t.Logf("kill %d: broker %d (pid %d) SIGKILLed at %d of %d events published; leader moved to broker %d after %s; relays' first ack on partition %d after %s (longest gap between any acks %s); broker back in the ISR %s after its restart",
			i+1, k.broker, k.pid, k.publishedAt, foTotal, k.newLeader, k.moved.Round(time.Millisecond), f.partition, k.stall.Round(time.Millisecond), k.gap.Round(time.Millisecond), k.rejoined.Round(time.Millisecond))
		kills = append(kills, k)
	}
	f.waitApplied(ctx, t)
	drain := time.Since(start)

	var rows, distinct, outOfOrder, pending int
	require.NoError(t, f.db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT event_id) FROM failover_effects`).Scan(&rows, &distinct))
	require.NoError(t, f.db.QueryRowContext(ctx, `SELECT count(*) FROM (
		SELECT seq, row_number() OVER (PARTITION BY agg ORDER BY id) AS n FROM failover_effects) x WHERE seq <> n`).Scan(&outOfOrder))
	require.NoError(t, f.db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`).Scan(&pending))
	stats := f.dedup.Stats()
	t.Logf("failover: %d events in %s (%d relays, %d partitions, 2 consumers): lost %d, duplicate effects %d, out of order %d; Kafka delivered %d copies (%d dropped by the idempotency middleware); relay publish errors %d",
		foTotal, drain.Round(time.Millisecond), foRelays, foPartitions, foTotal-distinct, rows-distinct, outOfOrder, f.deliveries.Load(), stats.Duplicates, f.pub.failures.Load())
	for i, k := range kills {
		t.Logf("failover: kill %d stalled the relays' publishes to the partition for %s", i+1, k.stall.Round(time.Millisecond))
	}
	require.Equal(t, foTotal, distinct, "events lost")
	require.Equal(t, distinct, rows, "duplicate effects")
	require.Zero(t, outOfOrder, "effects applied out of aggregate order")
	require.Zero(t, pending, "outbox rows not published")
	for i, k := range kills {
		require.Less(t, k.stall, foStallBound, "kill %d stalled the partition's publishes too long", i+1)
	}
}

type failover struct {
	brokers   []string
	topic     string
	partition int32 // the busiest partition: the one whose leader dies
	db        *sql.DB
	schema    *pgtest.Schema
	dedup     *idempotency.Middleware
	pub       *ackClock
	admin     sarama.Client
	relayPubs []*Publisher

	deliveries atomic.Int64
}

func setupFailover(ctx context.Context, t *testing.T, brokers []string) *failover {
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations())
	_, err := s.DB.ExecContext(ctx, `CREATE TABLE failover_effects (id bigserial PRIMARY KEY, event_id text NOT NULL, agg text NOT NULL, seq int NOT NULL)`)
	require.NoError(t, err)
	f := &failover{brokers: brokers, topic: "failover_" + watermill.NewShortUUID(), schema: s, db: s.DB}
	f.partition = busiestPartition()

	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Metadata.Retry.Max = 1
	f.admin, err = sarama.NewClient(brokers, sc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.admin.Close() })
	ca, err := sarama.NewClusterAdminFromClient(f.admin)
	require.NoError(t, err)
	require.NoError(t, ca.CreateTopic(f.topic, &sarama.TopicDetail{NumPartitions: foPartitions, ReplicationFactor: 3}, false))
	require.NoError(t, f.awaitISR(ctx, 3, time.Minute), "the new topic's partition %d never had 3 in-sync replicas", f.partition)

	f.startConsumers(ctx, t)
	return f
}

// busiestPartition is the partition most of the aggregates' keys land on.
func busiestPartition() int32 {
	n := make([]int, foPartitions)
	for a := range foAggregates {
		n[partitionForKey([]byte(foKey(a)), foPartitions)]++
	}
	best := 0
	for p := range n {
		if n[p] > n[best] {
			best = p
		}
	}
	return int32(best)
}

// foKey is aggregate a's ordering key as the relay sets it.
func foKey(a int) string { return fmt.Sprintf("order/agg-%04d", a) }

// writeBacklog writes events from to through of every aggregate, each
// aggregate's in sequence order, aggregates interleaved, 1,000 to a
// transaction.
func (f *failover) writeBacklog(ctx context.Context, t *testing.T, from, through int) {
	begin := time.Now()
	for seq := from; seq <= through; seq++ {
		events := make([]outbox.Event, 0, foAggregates)
		for a := range foAggregates {
			agg := fmt.Sprintf("agg-%04d", a)
			payload, _ := json.Marshal(foEvent{Agg: agg, Seq: seq})
			events = append(events, outbox.Event{Topic: f.topic, AggregateType: "order", AggregateID: agg, EventType: "test.failover.v1", Payload: payload})
		}
		tx, err := f.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, outbox.Add(ctx, postgres.SQLTx(tx), events...))
		require.NoError(t, tx.Commit())
	}
	t.Logf("failover: wrote events %d to %d of each aggregate (%d events) in %s", from, through, (through-from+1)*foAggregates, time.Since(begin).Round(time.Millisecond))
}

// openCluster opens the transport on the cluster.
func (f *failover) openCluster(ctx context.Context, t *testing.T) *Transport {
	tr, err := Open(ctx, Config{Brokers: f.brokers, Partitions: foPartitions, ReplicationFactor: 3, ClientID: "millwright-failover"}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

func (f *failover) startConsumers(ctx context.Context, t *testing.T) {
	store, err := idempotency.NewPostgresStore(postgres.From(f.poolOf(t, 14)))
	require.NoError(t, err)
	f.dedup, err = idempotency.NewMiddleware(store, idempotency.Config{Consumer: "failover"})
	require.NoError(t, err)
	tr := f.openCluster(ctx, t)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, nil)
	require.NoError(t, err)
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			f.deliveries.Add(1)
			return h(msg)
		}
	}
	group := "failover-" + f.topic
	for i := range 2 {
		sub, err := tr.Subscriber(group)
		require.NoError(t, err)
		h := router.AddConsumerHandler(fmt.Sprintf("failover-%d", i), f.topic, sub, f.apply)
		h.AddMiddleware(count, f.dedup.Middleware)
	}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
	})
	select {
	case <-router.Running():
	case err := <-done:
		t.Fatalf("router stopped: %v", err)
	case <-ctx.Done():
		t.Fatal("router did not start")
	}
}

// apply is the consumers' effect: one row, in the middleware's
// transaction, so it commits with the mark.
func (f *failover) apply(msg *message.Message) error {
	pt, ok := idempotency.TxFromContext(msg.Context())
	tx := pt.SQL()
	if !ok {
		return errors.New("handler ran without the idempotency middleware's transaction")
	}
	var ev foEvent
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return failure.Permanent(fmt.Errorf("payload of %s: %w", msg.UUID, err))
	}
	_, err := tx.ExecContext(msg.Context(), `INSERT INTO failover_effects (event_id, agg, seq) VALUES ($1, $2, $3)`,
		msg.Metadata.Get(metadata.EventID), ev.Agg, ev.Seq)
	return err
}

// poolOf is a pool on the test's schema of at most n connections.
func (f *failover) poolOf(t *testing.T, n int) *sql.DB {
	db, err := sql.Open("postgres", f.schema.URL)
	require.NoError(t, err)
	db.SetMaxOpenConns(n)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func (f *failover) startRelays(ctx context.Context, t *testing.T) {
	f.pub = &ackClock{partition: f.partition}
	for i := range foRelays {
		tr := f.openCluster(ctx, t)
		f.relayPubs = append(f.relayPubs, tr.pub)
		rel, err := relay.New(postgres.From(f.poolOf(t, 6)), f.pub.wrap(tr.pub), relay.Config{
			BatchSize: 500, PollInterval: 50 * time.Millisecond,
			Retry: retry.Policy{InitialInterval: 100 * time.Millisecond, MaxInterval: time.Second, MaxAttempts: -1},
		})
		require.NoError(t, err, "relay %d", i)
		done := make(chan error, 1)
		go func() { done <- rel.Run(ctx) }()
		t.Cleanup(func() {
			require.NoError(t, rel.Close())
			require.NoError(t, <-done)
		})
	}
}

// waitPublished waits until the relays had n events acknowledged.
func (f *failover) waitPublished(ctx context.Context, t *testing.T, n int64) {
	for f.pub.acked.Load() < n {
		select {
		case <-ctx.Done():
			t.Fatalf("the relays published %d of the %d events awaited: %v", f.pub.acked.Load(), n, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// waitApplied waits until every event's effect is applied, or until
// nothing more was applied for foQuiet while the outbox has nothing
// pending: what is missing then is lost, and the test says how many.
func (f *failover) waitApplied(ctx context.Context, t *testing.T) {
	last, since := -1, time.Now()
	for {
		var n, pending int
		require.NoError(t, f.db.QueryRowContext(ctx, `SELECT count(DISTINCT event_id) FROM failover_effects`).Scan(&n))
		if n >= foTotal {
			return
		}
		if n != last {
			last, since = n, time.Now()
		}
		require.NoError(t, f.db.QueryRowContext(ctx, `SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`).Scan(&pending))
		if pending == 0 && time.Since(since) > foQuiet {
			t.Fatalf("lost %d events: %d of %d applied, every outbox row published, and nothing applied for %s", foTotal-n, n, foTotal, foQuiet)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of %d events applied (%d published): %v", n, foTotal, f.pub.acked.Load(), ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// foQuiet is how long waitApplied waits for the consumers' next effect
// once the outbox is drained (a rebalance after a broker's return takes
// seconds; consumers behind by a minute are not keeping up).
const foQuiet = 60 * time.Second

// killReport is what one kill did.
type killReport struct {
	broker, newLeader int32
	pid               int
	publishedAt       int64
	killedAt          time.Time
	moved             time.Duration // kill -> metadata names another leader
	stall             time.Duration // kill -> the relays' first ack on the partition
	gap               time.Duration // longest gap between any two acks after the kill
	rejoined          time.Duration // restart -> back in the partition's ISR
}

var killedLine = regexp.MustCompile(`^killed broker (\d+) pid (\d+) at (\d+)`)

// killLeader SIGKILLs the busiest partition's leader with the script's
// kill-leader and proves it: the broker it names led the partition, its
// process is gone, and the partition's leader moves.
func (f *failover) killLeader(ctx context.Context, t *testing.T) killReport {
	before, err := f.leader()
	require.NoError(t, err)
	out := services(t, "cluster", "kill-leader", f.topic, strconv.Itoa(int(f.partition)))
	m := killedLine.FindStringSubmatch(out)
	require.NotNil(t, m, "kill-leader printed %q", out)
	broker, _ := strconv.Atoi(m[1])
	pid, _ := strconv.Atoi(m[2])
	ms, _ := strconv.ParseInt(m[3], 10, 64)
	k := killReport{broker: int32(broker), pid: pid, killedAt: time.UnixMilli(ms), publishedAt: f.pub.acked.Load()}
	// A test that fails before restart leaves no node down for the next.
	t.Cleanup(func() { services(t, "cluster", "start-broker", m[1]) })
	f.pub.markKill(k.killedAt)
	require.Equal(t, before, k.broker, "kill-leader killed broker %d, but the leader of partition %d was %d", k.broker, f.partition, before)
	require.ErrorIs(t, syscall.Kill(pid, 0), syscall.ESRCH, "broker %d's process %d still exists after SIGKILL", broker, pid)
	require.Less(t, k.publishedAt, int64(foTotal), "the drain had ended before the kill")

	deadline := time.Now().Add(time.Minute)
	for {
		l, err := f.leader()
		if err == nil && l != k.broker && l >= 0 {
			k.newLeader, k.moved = l, time.Since(k.killedAt)
			break
		}
		require.True(t, time.Now().Before(deadline), "partition %d's leader is still %d (err %v) a minute after SIGKILL", f.partition, l, err)
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	return k
}

// restart waits until the relays publish to the partition again (the
// kill's stall), then starts the killed broker again and waits until it
// is back in the partition's ISR (so the next kill leaves two in-sync
// replicas).
func (f *failover) restart(ctx context.Context, t *testing.T, k *killReport) {
	deadline := time.Now().Add(2 * foStallBound)
	for {
		if k.stall, k.gap = f.pub.stallSince(k.killedAt); k.stall > 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no publish to partition %d was acknowledged within %s of the kill", f.partition, 2*foStallBound)
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	begin := time.Now()
	services(t, "cluster", "start-broker", strconv.Itoa(int(k.broker)))
	require.NoError(t, f.awaitISR(ctx, 3, 2*time.Minute), "broker %d did not rejoin partition %d's ISR", k.broker, f.partition)
	k.rejoined = time.Since(begin)
}

// leader is the partition's leader, from fresh metadata.
func (f *failover) leader() (int32, error) {
	if err := f.admin.RefreshMetadata(f.topic); err != nil {
		return -1, err
	}
	b, err := f.admin.Leader(f.topic, f.partition)
	if err != nil {
		return -1, err
	}
	return b.ID(), nil
}

// awaitISR waits until the partition has n in-sync replicas.
func (f *failover) awaitISR(ctx context.Context, n int, bound time.Duration) error {
	deadline := time.Now().Add(bound)
	for {
		err := f.admin.RefreshMetadata(f.topic)
		if err == nil {
			isr, ierr := f.admin.InSyncReplicas(f.topic, f.partition)
			if ierr == nil && len(isr) >= n {
				return nil
			}
			err = fmt.Errorf("ISR %v, err %v", isr, ierr)
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// services runs scripts/services.sh with args and returns its stdout;
// the test fails, with the script's output, if it fails.
func services(t *testing.T, args ...string) string {
	t.Helper()
	script, err := filepath.Abs(filepath.Join("..", "..", "scripts", "services.sh"))
	require.NoError(t, err)
	cmd := exec.Command("bash", append([]string{script}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "scripts/services.sh %s: %s%s", strings.Join(args, " "), out, stderr.String())
	return string(out)
}

// ackClock wraps the relays' publishers: it counts acknowledged events
// and keeps the times of acknowledgements, those on the watched
// partition apart, to measure how long a kill stalled the relays.
type ackClock struct {
	partition int32
	acked     atomic.Int64
	failures  atomic.Int64

	mu     sync.Mutex
	kill   time.Time
	acks   []time.Time // every ack batch since the last kill
	onPart []time.Time
}

func (c *ackClock) markKill(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.kill = at
	c.acks = c.acks[:0]
	c.onPart = c.onPart[:0]
}

// stallSince is the time from kill to the first acknowledgement of an
// event on the watched partition, and the longest gap between any two
// acknowledgements (any partition) from the kill up to that one.
func (c *ackClock) stallSince(kill time.Time) (stall, gap time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var first time.Time
	for _, a := range c.onPart {
		if a.After(kill) {
			first = a
			break
		}
	}
	if first.IsZero() {
		return 0, 0
	}
	prev := kill
	for _, a := range c.acks {
		if a.Before(kill) || a.After(first) {
			continue
		}
		gap = max(gap, a.Sub(prev))
		prev = a
	}
	return first.Sub(kill), max(gap, first.Sub(prev))
}

func (c *ackClock) wrap(p *Publisher) message.Publisher { return &clockedPublisher{Publisher: p, c: c} }

type clockedPublisher struct {
	*Publisher
	c *ackClock
}

func (p *clockedPublisher) PublishBatch(topic string, msgs ...*message.Message) error {
	err := p.Publisher.PublishBatch(topic, msgs...)
	now := time.Now()
	var failed map[int]error
	var be *batch.Error
	switch {
	case err == nil:
	case errors.As(err, &be):
		failed = be.Failed
	default:
		p.c.failures.Add(int64(len(msgs)))
		return err
	}
	p.c.failures.Add(int64(len(failed)))
	acked, onPart := 0, false
	for i, m := range msgs {
		if _, bad := failed[i]; bad {
			continue
		}
		acked++
		onPart = onPart || partitionForKey([]byte(m.Metadata.Get(metadata.OrderingKey)), foPartitions) == p.c.partition
	}
	p.c.acked.Add(int64(acked))
	if acked > 0 {
		p.c.mu.Lock()
		p.c.acks = append(p.c.acks, now)
		if onPart {
			p.c.onPart = append(p.c.onPart, now)
		}
		p.c.mu.Unlock()
	}
	return err
}
