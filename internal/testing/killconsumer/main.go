// Command killconsumer is a consumer for tests that SIGKILL a consumer
// process mid-stream (transport's TestConsumerKilledMidStream): it
// subscribes, prints one line per delivery ("got <uuid>"), acks the first
// -ack deliveries and holds every later one unacked, and runs until it is
// killed. It is not for users.
//
// With -client millwright it subscribes through transport.Open with the
// JSON transport.Config in $KILLCONSUMER_CONFIG; with -client google it
// uses cloud.google.com/go/pubsub alone (the emulator from
// $PUBSUB_EMULATOR_HOST), to tell the emulator's behaviour from
// millwright's.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	"cloud.google.com/go/pubsub"
	"google.golang.org/api/option"
	"google.golang.org/grpc"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all"
	"github.com/millwright/millwright/transport/googlecloud"
)

// EnvConfig holds the JSON transport.Config of -client millwright.
const EnvConfig = "KILLCONSUMER_CONFIG"

func main() {
	client := flag.String("client", "millwright", "millwright or google")
	topic := flag.String("topic", "", "topic (millwright)")
	group := flag.String("group", "", "consumer group (millwright)")
	project := flag.String("project", "", "project (google)")
	sub := flag.String("sub", "", "subscription (google)")
	maxExt := flag.Duration("max-extension", 0, "ReceiveSettings.MaxExtensionPeriod (google)")
	deadline := flag.Duration("stream-deadline", 0, "gRPC deadline of each streaming pull, as googlecloud sets on the emulator (google; 0: none)")
	streams := flag.Int("streams", 0, "ReceiveSettings.NumGoroutines (google; 0: the client's default)")
	ack := flag.Int("ack", 0, "deliveries to ack before holding the rest")
	flag.Parse()
	out := &printer{w: bufio.NewWriter(os.Stdout)}
	var err error
	switch *client {
	case "millwright":
		err = millwright(*topic, *group, *ack, out)
	case "google":
		err = google(*project, *sub, *maxExt, *deadline, *streams, *ack, out)
	default:
		err = fmt.Errorf("-client %q: want millwright or google", *client)
	}
	fmt.Fprintln(os.Stderr, "killconsumer:", err)
	os.Exit(1)
}

type printer struct {
	mu   sync.Mutex
	w    *bufio.Writer
	seen int
}

// got prints the delivery and reports whether to ack it.
func (p *printer) got(id string, ack int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seen++
	fmt.Fprintf(p.w, "got %s\n", id)
	_ = p.w.Flush()
	return p.seen <= ack
}

func millwright(topic, group string, ack int, out *printer) error {
	var cfg transport.Config
	if err := json.Unmarshal([]byte(os.Getenv(EnvConfig)), &cfg); err != nil {
		return fmt.Errorf("$%s: %w", EnvConfig, err)
	}
	ctx := context.Background()
	tr, err := transport.Open(ctx, cfg)
	if err != nil {
		return err
	}
	s, err := tr.Subscriber(group)
	if err != nil {
		return err
	}
	msgs, err := s.Subscribe(ctx, topic)
	if err != nil {
		return err
	}
	for m := range msgs {
		if out.got(m.UUID, ack) {
			m.Ack()
		}
	}
	return fmt.Errorf("the subscription to %s closed", topic)
}

func google(project, sub string, maxExt, deadline time.Duration, streams, ack int, out *printer) error {
	ctx := context.Background()
	c, err := pubsub.NewClient(ctx, project, StreamDeadline(deadline)...)
	if err != nil {
		return err
	}
	s := c.Subscription(sub)
	s.ReceiveSettings.MaxExtensionPeriod = maxExt
	if streams > 0 {
		s.ReceiveSettings.NumGoroutines = streams
	}
	hold := make(chan struct{})
	return s.Receive(ctx, func(_ context.Context, m *pubsub.Message) {
		if out.got(string(m.Data), ack) {
			m.Ack()
			return
		}
		<-hold // like watermill-googlecloud: the callback waits for an ack
	})
}

// StreamDeadline returns client options that give every streaming pull a
// gRPC deadline of d, as transport/googlecloud does on the emulator; none
// for d == 0.
func StreamDeadline(d time.Duration) []option.ClientOption {
	if d == 0 {
		return nil
	}
	return []option.ClientOption{option.WithGRPCDialOption(grpc.WithChainStreamInterceptor(googlecloud.StreamDeadline(d)))}
}
