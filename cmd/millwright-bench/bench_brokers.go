package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	tnats "github.com/millwright/millwright/transport/nats"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"cloud.google.com/go/pubsub"
	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
	"github.com/millwright/millwright/transport/googlecloud"
)

// defaultAMQPURL is the local development RabbitMQ.
const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// benchPubSubProject is the project the benchmarks use on a Pub/Sub
// emulator, which accepts any.
const benchPubSubProject = "millwright-bench"

// addBenchBrokerFlags adds the flags that choose the brokers of a
// benchmark: --kafka-brokers, --pubsub-emulator and --amqp-url. Like
// --database-url they default from the MILLWRIGHT_ variables that
// transport.FromEnv reads, so one environment serves the services and
// their benchmarks. Kafka and Pub/Sub fall back to in-process fakes, which
// run without setup but time differently from the real services (see
// package embedded); the rows name the broker so the two are never mixed up.
func addBenchBrokerFlags(cmd *cobra.Command) {
	f := cmd.Flags()
	f.String("kafka-brokers", "", "comma-separated host:port of a real Kafka (default $"+transport.EnvKafkaBrokers+", else an embedded kfake cluster; an explicit empty value forces kfake)")
	f.String("pubsub-emulator", "", "host:port of a Pub/Sub emulator (default $"+transport.EnvPubSubEmulatorHost+", else an embedded pstest server; an explicit empty value forces pstest)")
	f.String("amqp-url", "", "RabbitMQ URL (default $"+transport.EnvAMQPURL+", else "+defaultAMQPURL+")")
	f.String("nats-url", "", "nats-server URL, JetStream enabled (default $"+transport.EnvNATSURL+", else "+defaultNATSURL+")")
}

// defaultNATSURL is where scripts/services.sh runs nats-server.
const defaultNATSURL = "nats://127.0.0.1:4222"

// benchBrokers is the broker choice of one benchmark run, read from the
// flags addBenchBrokerFlags adds.
type benchBrokers struct {
	kafka    []string // empty: embedded kfake
	emulator string   // empty: embedded pstest
	amqpURL  string
	natsURL  string
	// from says where each real broker came from ("--kafka-brokers" or
	// the variable), for the notice.
	from map[transport.Kind]string
}

// benchBrokersFromFlags reads the broker flags, falling back to the
// environment for those not given on the command line.
func benchBrokersFromFlags(cmd *cobra.Command) (benchBrokers, error) {
	f := cmd.Flags()
	b := benchBrokers{from: map[transport.Kind]string{}}
	// value returns the flag if given (even empty, to opt out of the
	// variable), else the variable.
	value := func(flag, env string) (string, string) {
		if f.Changed(flag) {
			v, _ := f.GetString(flag)
			return strings.TrimSpace(v), "--" + flag
		}
		return strings.TrimSpace(os.Getenv(env)), "$" + env
	}
	v, from := value("kafka-brokers", transport.EnvKafkaBrokers)
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			b.kafka = append(b.kafka, s)
		}
	}
	if len(b.kafka) > 0 {
		c := transport.Config{Kind: transport.Kafka}
		c.Kafka.Brokers = b.kafka
		if err := c.Validate(); err != nil {
			return b, fmt.Errorf("%s %q: %w", from, v, err)
		}
		b.from[transport.Kafka] = from
	}
	b.emulator, from = value("pubsub-emulator", transport.EnvPubSubEmulatorHost)
	if b.emulator != "" {
		if !strings.Contains(b.emulator, ":") || strings.Contains(b.emulator, "://") {
			return b, fmt.Errorf("%s %q: want host:port of a Pub/Sub emulator, such as 127.0.0.1:8085", from, b.emulator)
		}
		b.from[transport.GoogleCloud] = from
	}
	b.amqpURL, _ = value("amqp-url", transport.EnvAMQPURL)
	if b.amqpURL == "" {
		b.amqpURL = defaultAMQPURL
	}
	b.natsURL, _ = value("nats-url", transport.EnvNATSURL)
	if b.natsURL == "" {
		b.natsURL = defaultNATSURL
	}
	return b, nil
}

// benchBroker is the broker one kind of a benchmark runs against.
type benchBroker struct {
	// Config reaches the broker.
	Config transport.Config
	// Label names the broker in the rows: "kfake" and "pstest" for the
	// in-process fakes, "kafka HOST:PORT", "pubsub-emulator HOST:PORT" and
	// "rabbitmq HOST:PORT" for real ones, "in-process" for gochannel.
	Label string
	stop  func()
}

// Close stops the broker if it is an in-process fake.
func (b benchBroker) Close() {
	if b.stop != nil {
		b.stop()
	}
}

// sinkGroup is the consumer group the benchmarks consume with. The outbox
// benchmark's publishers declare it up front on RabbitMQ and Pub/Sub
// (DeclareGroups), so that its drain, which publishes with nothing
// consuming, is not refused as unreceived (amqp.ErrUnroutable,
// googlecloud.ErrNoSubscription) and measures the publish a service makes.
const sinkGroup = "bench"

// dropTopics deletes, best effort, topics a benchmark created on a real
// Kafka, the exchanges and sinkGroup queues of the topics on RabbitMQ, and
// the streams of the topics on NATS, the sinkGroup subscriptions of the
// topics on a Pub/Sub emulator (both
// hold what the drain published): each run uses topics of its own, which
// would otherwise pile up on the broker. Fakes are discarded whole; other
// kinds keep theirs.
func (b benchBroker) dropTopics(ctx context.Context, topics ...string) {
	if b.stop == nil && b.Config.Kind == transport.AMQP && len(topics) > 0 {
		_ = amqp.DeleteTopology(b.Config.AMQP.URL, topics, sinkGroup)
		return
	}
	if b.stop == nil && b.Config.Kind == transport.GoogleCloud && b.Config.GoogleCloud.EmulatorHost != "" && len(topics) > 0 {
		dropSinkSubscriptions(ctx, b.Config.GoogleCloud, topics)
		return
	}
	if b.Config.Kind == transport.NATS {
		for _, t := range topics {
			deleteNATSStream(b.Config.NATS.URL, t)
		}
		return
	}
	if b.stop != nil || b.Config.Kind != transport.Kafka || len(topics) == 0 {
		return
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Config.Kafka.Brokers...))
	if err != nil {
		return
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req := kmsg.NewPtrDeleteTopicsRequest()
	req.TimeoutMillis = 10000
	for _, t := range topics {
		rt := kmsg.NewDeleteTopicsRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
		req.TopicNames = append(req.TopicNames, t)
	}
	_, _ = req.RequestWith(ctx, cl)
}

// dropSinkSubscriptions deletes the sinkGroup subscription of each topic
// on the Pub/Sub emulator of c, best effort.
func dropSinkSubscriptions(ctx context.Context, c googlecloud.Config, topics []string) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cl, err := pubsub.NewClient(ctx, c.ProjectID, option.WithEndpoint(c.EmulatorHost), option.WithoutAuthentication(),
		option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())))
	if err != nil {
		return
	}
	defer cl.Close()
	for _, t := range topics {
		_ = cl.Subscription(googlecloud.SubscriptionName(t, sinkGroup)).Delete(ctx)
	}
}

// open returns the broker of kind, starting a fresh fake when no real one
// is configured (so a fake's state never carries from one section of a
// benchmark to the next). sql is not a broker: the benchmarks build its
// Config from their scratch schema, with postgresLabel.
func (b benchBrokers) open(kind transport.Kind) (benchBroker, error) {
	switch kind {
	case transport.GoChannel:
		return benchBroker{Config: transport.Config{Kind: kind}, Label: "in-process"}, nil
	case transport.Kafka:
		if len(b.kafka) > 0 {
			c := transport.Config{Kind: kind}
			c.Kafka.Brokers = b.kafka
			return benchBroker{Config: c, Label: "kafka " + strings.Join(b.kafka, ",")}, nil
		}
		k, err := embedded.Kafka()
		if err != nil {
			return benchBroker{}, err
		}
		return benchBroker{Config: k.Config(), Label: "kfake", stop: func() { _ = k.Close() }}, nil
	case transport.GoogleCloud:
		if b.emulator != "" {
			c := transport.Config{Kind: kind}
			c.GoogleCloud.ProjectID, c.GoogleCloud.EmulatorHost = benchPubSubProject, b.emulator
			return benchBroker{Config: c, Label: "pubsub-emulator " + b.emulator}, nil
		}
		ps, err := embedded.PubSub()
		if err != nil {
			return benchBroker{}, err
		}
		return benchBroker{Config: ps.Config(), Label: "pstest", stop: func() { _ = ps.Close() }}, nil
	case transport.AMQP:
		c := transport.Config{Kind: kind}
		c.AMQP.URL = b.amqpURL
		return benchBroker{Config: c, Label: "rabbitmq " + urlHost(b.amqpURL)}, nil
	case transport.NATS:
		c := transport.Config{Kind: kind}
		c.NATS.URL = b.natsURL
		return benchBroker{Config: c, Label: "nats " + urlHost(b.natsURL)}, nil
	}
	return benchBroker{}, fmt.Errorf("no broker for transport %q", kind)
}

// notice describes the real brokers among kinds and where they came from,
// one line each, so that a broker taken from the environment is never a
// surprise. Fakes need no notice: their rows say kfake or pstest.
func (b benchBrokers) notice(kinds []transport.Kind) []string {
	var lines []string
	for _, k := range kinds {
		switch from := b.from[k]; {
		case from == "":
		case k == transport.Kafka:
			lines = append(lines, fmt.Sprintf("kafka: real brokers %s (from %s)", strings.Join(b.kafka, ","), from))
		case k == transport.GoogleCloud:
			lines = append(lines, fmt.Sprintf("googlecloud: Pub/Sub emulator %s (from %s)", b.emulator, from))
		}
	}
	return lines
}

// postgresLabel names the Postgres server of a URL without its
// credentials, for the sql kind's rows.
func postgresLabel(u string) string { return "postgres " + urlHost(u) }

// urlHost is the host:port of a URL, or a placeholder: never the
// credentials.
func urlHost(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "(unparseable URL)"
	}
	return u.Host
}

// benchKinds parses --kinds against the kinds a benchmark supports, in the
// order given, without repeats. A kind the benchmark does not support is
// refused by name with the supported list.
func benchKinds(bench string, given []string, supported ...transport.Kind) ([]transport.Kind, error) {
	names := make([]string, len(supported))
	for i, k := range supported {
		names[i] = string(k)
	}
	want := strings.Join(names, ", ")
	var kinds []transport.Kind
	seen := map[transport.Kind]bool{}
	for _, s := range given {
		k := transport.Kind(strings.ToLower(strings.TrimSpace(s)))
		if k == "" || seen[k] {
			continue
		}
		ok := false
		for _, x := range supported {
			ok = ok || x == k
		}
		known := false
		for _, x := range transport.Kinds {
			known = known || x == k
		}
		switch {
		case ok:
		case known:
			return nil, fmt.Errorf("bench %s: --kinds %s: this benchmark does not run on %s: want one of %s", bench, k, k, want)
		default:
			return nil, fmt.Errorf("bench %s: --kinds: invalid transport %q: want one of %s", bench, s, want)
		}
		seen[k] = true
		kinds = append(kinds, k)
	}
	if len(kinds) == 0 {
		return nil, fmt.Errorf("bench %s: --kinds is empty: want one or more of %s", bench, want)
	}
	return kinds, nil
}

// deleteNATSStream deletes, best effort, the stream of topic.
func deleteNATSStream(url, topic string) {
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
