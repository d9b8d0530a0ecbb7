package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
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

// A service's own operator tool replays one dead letter as the console
// and `millwright dlq replay` do: in one transaction, the dead letter
// leaves the dead state, its message is queued in the outbox (a relay
// publishes it) and the audit row names the operator.
func ExampleReplayTx() {
	ctx := context.Background()
	var db postgres.DB // postgres.From(pool), on the schema of the dead letters and the outbox
	err := db.InTx(ctx, func(tx postgres.Tx) error {
		item, err := dlq.ReplayTx(ctx, tx, 42, dlq.ReplayOneOptions{By: audit.Operator{User: "alice"}})
		if err == nil {
			fmt.Printf("queued dead letter %d to %s\n", item.ID, item.To)
		}
		return err
	})
	switch {
	case errors.Is(err, dlq.ErrNotDead):
		fmt.Println("already replayed by someone else: nothing queued")
	case err != nil:
		fmt.Println(err)
	}
}
