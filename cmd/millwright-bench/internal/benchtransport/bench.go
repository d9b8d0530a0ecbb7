// Package benchtransport measures the cost of package transport against
// Watermill's own publishers and subscribers built directly, with the same
// broker settings, on the same broker, in the same run.
package benchtransport

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"cloud.google.com/go/pubsub"
	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wgochannel "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // benchmarks every kind
	"github.com/millwright/millwright/transport/amqp"
	tnats "github.com/millwright/millwright/transport/nats"
)

// Row is one measured case.
type Row struct {
	Bench      string    `json:"bench"`
	Kind       string    `json:"kind"`
	Publishers int       `json:"publishers"`
	Messages   int       `json:"messages"`
	Millwright float64   `json:"millwright_msgs_per_s"`
	Watermill  float64   `json:"watermill_msgs_per_s"`
	Ratio      float64   `json:"ratio"`
	RunsMW     []float64 `json:"runs_millwright"`
	RunsWM     []float64 `json:"runs_watermill"`
}

// Options selects what to run.
type Options struct {
	Configs    map[transport.Kind]transport.Config
	Publishers []int
	Messages   int
	Runs       int
	Payload    int
	// Step, if set, is called after each timed run (a layer's run of a
	// kind and publisher count) with the runs done and the runs in all.
	Step func(done, total int)
}

type pair struct {
	pub   message.Publisher
	sub   message.Subscriber
	close func()
}

// Run measures each kind with each publisher count. Runs alternate between
// the two layers so drift on a busy machine hits both alike; the figure is
// the median of Runs.
func Run(ctx context.Context, opts Options, emit func(Row)) error {
	payload := make([]byte, opts.Payload)
	for i := range payload {
		payload[i] = 'a' + byte(i%26)
	}
	done, total := 0, 0
	for _, kind := range transport.Kinds {
		if _, ok := opts.Configs[kind]; ok {
			total += len(opts.Publishers) * opts.Runs * 2
		}
	}
	for _, kind := range transport.Kinds {
		cfg, ok := opts.Configs[kind]
		if !ok {
			continue
		}
		for _, pubs := range opts.Publishers {
			row := Row{Bench: "transport", Kind: string(kind), Publishers: pubs, Messages: opts.Messages}
			for r := 0; r < opts.Runs; r++ {
				layers := []string{"millwright", "watermill"}
				if r%2 == 1 {
					layers[0], layers[1] = layers[1], layers[0]
				}
				for _, layer := range layers {
					var p pair
					var err error
					if layer == "millwright" {
						p, err = viaTransport(ctx, cfg)
					} else {
						p, err = direct(ctx, cfg)
					}
					if err != nil {
						return fmt.Errorf("%s %s: %w", kind, layer, err)
					}
					topic := "bench_" + watermill.NewShortUUID()
					rate, err := measure(ctx, p, topic, opts.Messages, pubs, payload)
					p.close()
					if kind == transport.AMQP {
						deleteAMQP(cfg.AMQP.URL, topic, "bench")
					}
					if kind == transport.NATS {
						deleteNATS(cfg.NATS.URL, topic)
					}
					if err != nil {
						return fmt.Errorf("%s %s, %d publishers: %w", kind, layer, pubs, err)
					}
					if layer == "millwright" {
						row.RunsMW = append(row.RunsMW, rate)
					} else {
						row.RunsWM = append(row.RunsWM, rate)
					}
					done++
					if opts.Step != nil {
						opts.Step(done, total)
					}
				}
			}
			row.Millwright, row.Watermill = median(row.RunsMW), median(row.RunsWM)
			if row.Watermill > 0 {
				row.Ratio = row.Millwright / row.Watermill
			}
			emit(row)
		}
	}
	return nil
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

// measure subscribes to a fresh topic, publishes n messages from `pubs`
// goroutines and returns messages per second from the first publish to
// the last ack.
func measure(ctx context.Context, p pair, topic string, n, pubs int, payload []byte) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if si, ok := p.sub.(message.SubscribeInitializer); ok {
		if err := si.SubscribeInitialize(topic); err != nil {
			return 0, err
		}
	}
	ch, err := p.sub.Subscribe(ctx, topic)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	var wg sync.WaitGroup
	errc := make(chan error, pubs)
	for w := 0; w < pubs; w++ {
		count := n / pubs
		if w < n%pubs {
			count++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < count; i++ {
				if err := p.pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	seen := make(map[string]struct{}, n)
	for len(seen) < n {
		select {
		case m, ok := <-ch:
			if !ok {
				return 0, errors.New("subscriber closed before all messages arrived")
			}
			seen[m.UUID] = struct{}{}
			m.Ack()
		case err := <-errc:
			return 0, err
		case <-ctx.Done():
			return 0, fmt.Errorf("received %d of %d messages: %w", len(seen), n, ctx.Err())
		}
	}
	elapsed := time.Since(start)
	wg.Wait()
	return float64(n) / elapsed.Seconds(), nil
}

// deleteAMQP removes the exchange and group queue a run declared, so
// benchmarks leave nothing behind on a shared broker.
func deleteAMQP(url, topic, group string) {
	_ = amqp.DeleteTopology(url, []string{topic}, group)
}

// deleteNATS removes the streams a run made (millwright's, or
// watermill-nats's, named after the topic).
func deleteNATS(url, topic string) {
	nc, err := natsgo.Connect(url)
	if err != nil {
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = js.DeleteStream(ctx, tnats.StreamName(topic))
}

func viaTransport(ctx context.Context, cfg transport.Config) (pair, error) {
	cfg.WaitForBroker = transport.NoWait // a benchmark fails at once on a broker that is down
	tr, err := transport.Open(ctx, cfg)
	if err != nil {
		return pair{}, err
	}
	sub, err := tr.Subscriber("bench")
	if err != nil {
		tr.Close()
		return pair{}, err
	}
	return pair{pub: tr.Publisher(), sub: sub, close: func() { _ = tr.Close() }}, nil
}

// direct builds Watermill's own publisher and subscriber with the settings
// the transport uses, so the ratio is the cost of the layer alone.
func direct(_ context.Context, cfg transport.Config) (pair, error) {
	logger := watermill.NopLogger{}
	switch cfg.Kind {
	case transport.GoChannel:
		ps := wgochannel.NewGoChannel(wgochannel.Config{OutputChannelBuffer: 1024, Persistent: true}, logger)
		return pair{pub: ps, sub: ps, close: func() { ps.Close() }}, nil

	case transport.Kafka:
		pc := wkafka.DefaultSaramaSyncPublisherConfig()
		pc.Producer.RequiredAcks = sarama.WaitForAll
		pc.Net.MaxOpenRequests = 1
		pc.Version = sarama.V2_1_0_0
		pub, err := wkafka.NewPublisher(wkafka.PublisherConfig{Brokers: cfg.Kafka.Brokers, Marshaler: wkafka.DefaultMarshaler{}, OverwriteSaramaConfig: pc}, logger)
		if err != nil {
			return pair{}, err
		}
		sc := wkafka.DefaultSaramaSubscriberConfig()
		sc.Consumer.Offsets.Initial = sarama.OffsetOldest
		sc.Version = sarama.V2_1_0_0
		sc.ChannelBufferSize = 10240
		sc.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
		sc.Consumer.Group.Rebalance.Timeout = 3 * time.Second
		sub, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
			Brokers: cfg.Kafka.Brokers, Unmarshaler: wkafka.DefaultMarshaler{}, OverwriteSaramaConfig: sc, ConsumerGroup: "bench",
			InitializeTopicDetails: &sarama.TopicDetail{NumPartitions: 8, ReplicationFactor: 1},
		}, logger)
		if err != nil {
			pub.Close()
			return pair{}, err
		}
		return pair{pub: pub, sub: sub, close: func() { sub.Close(); pub.Close() }}, nil

	case transport.AMQP:
		c := wamqp.NewDurablePubSubConfig(cfg.AMQP.URL, wamqp.GenerateQueueNameTopicNameWithSuffix("bench"))
		c.Consume.Qos.PrefetchCount = 100
		c.Publish.ChannelPoolSize = 8
		c.Publish.ConfirmDelivery = true
		pub, err := wamqp.NewPublisher(c, logger)
		if err != nil {
			return pair{}, err
		}
		sub, err := wamqp.NewSubscriber(c, logger)
		if err != nil {
			pub.Close()
			return pair{}, err
		}
		return pair{pub: pub, sub: sub, close: func() { sub.Close(); pub.Close() }}, nil

	case transport.NATS:
		// watermill-nats's JetStream publisher and subscriber: its stream
		// (named after the topic, created by SubscribeInitialize) and a
		// consumer of group "bench" on it.
		pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: cfg.NATS.URL, Logger: logger})
		if err != nil {
			return pair{}, err
		}
		sub, err := wnats.NewSubscriber(wnats.SubscriberConfig{URL: cfg.NATS.URL, Logger: logger, ResourceInitializer: wnats.GroupedConsumer("bench")})
		if err != nil {
			pub.Close()
			return pair{}, err
		}
		return pair{pub: pub, sub: sub, close: func() { sub.Close(); pub.Close() }}, nil

	case transport.GoogleCloud:
		var opts []option.ClientOption
		if h := cfg.GoogleCloud.EmulatorHost; h != "" {
			opts = append(opts, option.WithEndpoint(h), option.WithoutAuthentication(),
				option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())), option.WithTelemetryDisabled())
		}
		pub, err := wgc.NewPublisher(wgc.PublisherConfig{
			ProjectID: cfg.GoogleCloud.ProjectID, EnableMessageOrdering: true, EnableMessageOrderingAutoResumePublishOnError: true,
			PublishTimeout:  30 * time.Second,
			PublishSettings: &pubsub.PublishSettings{DelayThreshold: time.Millisecond, CountThreshold: 100, ByteThreshold: 1e6, Timeout: 30 * time.Second},
			ClientOptions:   opts,
		}, logger)
		if err != nil {
			return pair{}, err
		}
		sub, err := wgc.NewSubscriber(wgc.SubscriberConfig{
			ProjectID:                cfg.GoogleCloud.ProjectID,
			GenerateSubscriptionName: wgc.TopicSubscriptionNameWithSuffix("_bench"),
			ReceiveSettings:          pubsub.ReceiveSettings{MaxExtensionPeriod: 10 * time.Minute, MaxOutstandingMessages: 1000, MaxOutstandingBytes: 1e9, NumGoroutines: 10},
			SubscriptionConfig:       pubsub.SubscriptionConfig{EnableMessageOrdering: true},
			ClientOptions:            opts,
		}, logger)
		if err != nil {
			pub.Close()
			return pair{}, err
		}
		return pair{pub: pub, sub: sub, close: func() { sub.Close(); pub.Close() }}, nil

	case transport.SQL:
		db, err := stdsql.Open("postgres", cfg.SQL.URL)
		if err != nil {
			return pair{}, err
		}
		db.SetMaxOpenConns(10)
		schema := wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
		pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, logger)
		if err != nil {
			db.Close()
			return pair{}, err
		}
		sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
			ConsumerGroup: "bench", PollInterval: 100 * time.Millisecond, SchemaAdapter: schema,
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
		}, logger)
		if err != nil {
			pub.Close()
			db.Close()
			return pair{}, err
		}
		return pair{pub: pub, sub: sub, close: func() { sub.Close(); pub.Close(); db.Close() }}, nil
	}
	return pair{}, fmt.Errorf("no direct Watermill baseline for %q", cfg.Kind)
}
