package debeziumbench

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/deploy/debezium"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/kafka" // the relay publishes to Kafka
)

// createTopic creates topic on the brokers and waits for its leaders.
func (b *bench) createTopic(ctx context.Context, topic string) error {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, sarama.NewConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: b.cfg.Partitions, ReplicationFactor: 1}, false); err != nil {
		return fmt.Errorf("creating topic %s: %w", topic, err)
	}
	return nil
}

// deleteTopics removes the run's topics, best effort.
func (b *bench) deleteTopics(topics ...string) {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, sarama.NewConfig())
	if err != nil {
		return
	}
	defer admin.Close()
	for _, t := range topics {
		_ = admin.DeleteTopic(t)
	}
}

// records returns the number of records topic holds (the sum of its
// partitions' end offsets).
func records(client sarama.Client, topic string) (int64, error) {
	if err := client.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, p := range parts {
		off, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		n += off
	}
	return n, nil
}

// openTransport opens the Kafka transport the relay publishes with.
func (b *bench) openTransport(ctx context.Context) (*transport.Transport, error) {
	cfg := transport.Config{Kind: transport.Kafka}
	cfg.Kafka.Brokers = b.cfg.Brokers
	return transport.Open(ctx, cfg)
}

// startConnector creates the run's connector on its slot and waits until
// its task runs.
func (b *bench) startConnector(ctx context.Context) error {
	u, err := url.Parse(b.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("database URL: %w", err)
	}
	port := u.Port()
	if port == "" {
		port = "5432"
	}
	user := "postgres"
	if u.User != nil {
		user = u.User.Username()
	}
	dbname, host := strings.TrimPrefix(u.Path, "/"), u.Hostname()
	cfg, err := debezium.ConnectorConfig(debezium.ForSchema(dbname, b.schema, b.name, b.name))
	if err != nil {
		return err
	}
	cfg["database.hostname"], cfg["database.port"], cfg["database.user"] = host, port, user
	if err := b.connect.Put(ctx, b.name, cfg); err != nil {
		return err
	}
	return b.connect.WaitState(ctx, b.name, "RUNNING")
}

// arrivals consumes topic from the start and records when each event id
// first arrives.
type arrivals struct {
	mu   sync.Mutex
	at   map[string]time.Time
	c    sarama.Consumer
	done chan struct{}
}

func (b *bench) consume(topic string) (*arrivals, error) {
	cfg := sarama.NewConfig()
	c, err := sarama.NewConsumer(b.cfg.Brokers, cfg)
	if err != nil {
		return nil, err
	}
	a := &arrivals{at: map[string]time.Time{}, c: c}
	parts, err := c.Partitions(topic)
	if err != nil {
		c.Close()
		return nil, err
	}
	for _, p := range parts {
		// A topic just created may not have its leaders yet.
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		for deadline := time.Now().Add(30 * time.Second); err != nil && time.Now().Before(deadline); {
			time.Sleep(200 * time.Millisecond)
			pc, err = c.ConsumePartition(topic, p, sarama.OffsetOldest)
		}
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("consuming %s/%d: %w", topic, p, err)
		}
		go func() {
			for m := range pc.Messages() {
				now := time.Now()
				for _, h := range m.Headers {
					if string(h.Key) == "ce_id" {
						a.mu.Lock()
						if _, seen := a.at[string(h.Value)]; !seen {
							a.at[string(h.Value)] = now
						}
						a.mu.Unlock()
					}
				}
			}
		}()
	}
	return a, nil
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.at)
}

func (a *arrivals) close() { _ = a.c.Close() }
