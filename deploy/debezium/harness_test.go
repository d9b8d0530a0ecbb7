package debezium_test

import (
	"context"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/deploy/debezium"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/connecttest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/kafka"
)

// env is one test's outbox schema, Kafka topic and Debezium connector
// (not started: start does).
type env struct {
	schema  *pgtest.Schema
	q       storage.Querier
	connect *connecttest.Client
	brokers []string
	topic   string
	name    string // connector, slot and publication
	tr      *transport.Transport
}

func setup(t *testing.T, partitions int32) *env {
	t.Helper()
	connect := connecttest.FromEnv(t)
	brokers := strings.Split(os.Getenv("MILLWRIGHT_TEST_KAFKA_BROKERS"), ",")
	if brokers[0] == "" {
		t.Fatalf("%s is set but MILLWRIGHT_TEST_KAFKA_BROKERS is not: Debezium writes to a real broker", connecttest.EnvURL)
	}
	e := &env{schema: pgtest.New(t, outbox.Migrations()), connect: connect, brokers: brokers}
	q, err := storage.From(e.schema.DB)
	require.NoError(t, err)
	e.q = q
	e.name = "mw_" + e.schema.Name
	e.topic = "dbz_" + watermill.NewShortUUID()

	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	require.NoError(t, err)
	require.NoError(t, admin.CreateTopic(e.topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
	t.Cleanup(func() {
		_ = admin.DeleteTopic(e.topic)
		_ = admin.Close()
	})

	cfg := transport.Config{Kind: transport.Kafka}
	cfg.Kafka.Brokers = brokers
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e.tr, err = transport.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.tr.Close() })

	// Registered after pgtest.New: runs before the schema is dropped.
	t.Cleanup(func() { e.teardown(t) })
	return e
}

func (e *env) teardown(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := e.connect.Delete(ctx, e.name); err != nil {
		t.Logf("deleting connector %s: %v", e.name, err)
	}
	// The slot is free once the connector's task has let go of it.
	for ctx.Err() == nil {
		if err := storage.DropCaptureSlot(ctx, e.q, e.name); err == nil || !strings.Contains(err.Error(), "is active") {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	_ = storage.DisableCapture(ctx, e.q, e.name)
}

// start creates (or resumes) the connector on the env's slot and waits
// until its task runs.
func (e *env) start(ctx context.Context, t *testing.T) {
	t.Helper()
	u, err := url.Parse(pgtest.BaseURL())
	require.NoError(t, err)
	cfg, err := debezium.ConnectorConfig(debezium.ForSchema(strings.TrimPrefix(u.Path, "/"), e.schema.Name, e.name, e.name))
	require.NoError(t, err)
	cfg["database.hostname"], cfg["database.port"] = u.Hostname(), u.Port()
	if u.User != nil {
		cfg["database.user"] = u.User.Username()
	}
	require.NoError(t, e.connect.Put(ctx, e.name, cfg))
	require.NoError(t, e.connect.WaitState(ctx, e.name, "RUNNING"))
}

// record is one Kafka record as a consumer sees it.
type record struct {
	Partition int32
	Offset    int64
	Key       []byte
	Headers   map[string]string
	Value     []byte
}

// consumer reads every partition of a topic from the start.
type consumer struct {
	mu   sync.Mutex
	recs []record
	c    sarama.Consumer
	more chan struct{}
}

func (e *env) consume(t *testing.T) *consumer {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	c, err := sarama.NewConsumer(e.brokers, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	parts, err := c.Partitions(e.topic)
	require.NoError(t, err)
	k := &consumer{c: c, more: make(chan struct{}, 1)}
	for _, p := range parts {
		// A topic just created may not have its leaders yet.
		var pc sarama.PartitionConsumer
		deadline := time.Now().Add(30 * time.Second)
		for pc, err = c.ConsumePartition(e.topic, p, sarama.OffsetOldest); err != nil && time.Now().Before(deadline); {
			time.Sleep(200 * time.Millisecond)
			pc, err = c.ConsumePartition(e.topic, p, sarama.OffsetOldest)
		}
		require.NoError(t, err, "consuming %s/%d", e.topic, p)
		go func() {
			for m := range pc.Messages() {
				r := record{Partition: m.Partition, Offset: m.Offset, Key: m.Key, Value: m.Value, Headers: map[string]string{}}
				for _, h := range m.Headers {
					if _, dup := r.Headers[string(h.Key)]; dup {
						r.Headers[string(h.Key)+"#dup"] = string(h.Value)
					}
					r.Headers[string(h.Key)] = string(h.Value)
				}
				k.mu.Lock()
				k.recs = append(k.recs, r)
				k.mu.Unlock()
				select {
				case k.more <- struct{}{}:
				default:
				}
			}
		}()
	}
	return k
}

// wait returns the records once at least n have arrived.
func (k *consumer) wait(ctx context.Context, t *testing.T, n int) []record {
	t.Helper()
	for {
		k.mu.Lock()
		got := len(k.recs)
		out := append([]record(nil), k.recs...)
		k.mu.Unlock()
		if got >= n {
			return out
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of %d records arrived: %v", got, n, ctx.Err())
		case <-k.more:
		case <-time.After(time.Second):
		}
	}
}
