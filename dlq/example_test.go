package dlq_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// A handler that cannot decode its payload parks the message on
// "orders.dlq" at once; one that keeps failing parks it after its retries.
func ExampleNewMiddleware() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	deadLetters, _ := pubSub.Subscribe(context.Background(), "orders.dlq")

	mw, err := dlq.NewMiddleware(pubSub, dlq.Config{
		ConsumerGroup: "billing",
		Retry:         retry.Policy{InitialInterval: time.Millisecond, MaxAttempts: 3},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	router.AddMiddleware(mw.Middleware)
	router.AddConsumerHandler("charge", "orders", pubSub, func(msg *message.Message) error {
		var order struct{ Amount int }
		if err := dlq.DecodeJSON(msg, &order); err != nil {
			return err // malformed: straight to the dead-letter topic
		}
		return fmt.Errorf("payment provider unavailable")
	})
	go func() { _ = router.Run(context.Background()) }()
	defer router.Close()
	select {
	case <-router.Running():
	case <-time.After(10 * time.Second):
		fmt.Println("router not running after 10s")
		return
	}

	for _, payload := range []string{`{"Amount": `, `{"Amount": 10}`} {
		_ = pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte(payload)))
		var dl *message.Message
		select {
		case dl = <-deadLetters:
			dl.Ack()
		case <-time.After(10 * time.Second):
			fmt.Println("no dead letter within 10s")
			return
		}
		md := dl.Metadata
		fmt.Printf("%s: reason=%s attempts=%s type=%s\n", dl.Payload,
			md.Get(metadata.DeadLetterReason), md.Get(metadata.DeadLetterAttempts), md.Get(metadata.DeadLetterErrorType))
	}
	// Output:
	// {"Amount": : reason=malformed attempts=1 type=*json.SyntaxError
	// {"Amount": 10}: reason=exhausted attempts=3 type=*errors.errorString
}
