package transport_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/transport"
)

// The entry point: configuration selects the kind, the application code
// is the same for all five. In production the configuration comes from
// the environment (transport.FromEnv with MILLWRIGHT_TRANSPORT set to, say,
// kafka://h1:9092,h2:9092); here it is the in-process kind.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg, err := transport.ParseURL("mem://") // or transport.FromEnv()
	if err != nil {
		fmt.Println(err)
		return
	}
	tr, err := transport.Open(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tr.Close()

	sub, err := tr.Subscriber("billing") // a consumer group
	if err != nil {
		fmt.Println(err)
		return
	}
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := tr.Publisher().Publish("orders", message.NewMessage("m-1", []byte(`{"order_id":"o-1"}`))); err != nil {
		fmt.Println(err)
		return
	}
	select {
	case m := <-msgs:
		m.Ack()
		fmt.Println(tr, m.UUID, string(m.Payload))
	case <-ctx.Done():
		fmt.Println("nothing received")
	}
	// Output:
	// mem:// m-1 {"order_id":"o-1"}
}

// URLs select a kind and its address; development fakes have their own
// schemes; addresses that cannot work are refused with the fix.
func ExampleParseURL() {
	for _, u := range []string{"kafka://h1:9092,h2:9092", "kfake://", "pstest://my-project", "kafka://:9092", "mem://x"} {
		cfg, err := transport.ParseURL(u)
		if err != nil {
			fmt.Println("error:", err)
			continue
		}
		fmt.Println(cfg.Kind, cfg)
	}
	// Output:
	// kafka kafka://h1:9092,h2:9092
	// kafka kfake:// (in-process development fake)
	// googlecloud pstest://my-project (in-process development fake)
	// error: kafka: broker address ":9092" has no host: want host:port, e.g. 127.0.0.1:9092 (or MILLWRIGHT_TRANSPORT=kfake for the in-process development fake)
	// error: transport: mem:// takes no host or path (got "x"): write mem:// for the in-process gochannel transport
}
