package idempotency_test

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
)

// A consumer receives one event three times (a redelivery and a relay that
// published twice) and another event once; its handler runs once per event.
func ExampleMiddleware_Middleware() {
	store := idempotency.NewMemoryStore() // idempotency.NewPostgresStore(db) in production
	dedup, err := idempotency.NewMiddleware(store, idempotency.Config{
		Consumer:   "billing",
		Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("charging for", msg.Metadata.Get("ce_id"))
		return nil, nil
	})

	for _, id := range []string{"order-1", "order-1", "order-2", "order-1"} {
		if _, err := handler(idempotencytest.NewMessage(id, nil)); err != nil {
			fmt.Println(err)
		}
	}

	_, err = handler(message.NewMessage("no-id", nil))
	fmt.Println(err)
	// Output:
	// charging for order-1
	// charging for order-2
	// idempotency: consumer "billing": message no-id: message has no event id: set the "ce_id" metadata key when publishing (the outbox does) or configure Config.KeyFunc
}

// printingPublisher prints what it publishes; its first Publish fails, as
// a broker that is briefly down would.
type printingPublisher struct{ calls int }

func (p *printingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.calls++
	if p.calls == 1 {
		return errors.New("broker unavailable")
	}
	for _, m := range msgs {
		fmt.Printf("published to %s: %s\n", topic, m.Payload)
	}
	return nil
}

func (p *printingPublisher) Close() error { return nil }

// The messages a handler returns are published before the mark commits.
// The first publish fails: the message fails with no mark, and its
// redelivery runs the handler again and publishes; a later redelivery is
// a duplicate. In production prefer ProducedToOutbox with a PostgresStore:
// the follow-ups are then written with the mark and the handler's effects.
func ExampleConfig_producedPublisher() {
	dedup, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{
		Consumer:          "billing",
		ProducedPublisher: &printingPublisher{},
		ProducedTopic:     "invoices",
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("billing", msg.Metadata.Get("ce_id"))
		invoice := message.NewMessage(watermill.NewUUID(), []byte("invoice for "+msg.Metadata.Get("ce_id")))
		return []*message.Message{invoice}, nil
	})

	for delivery := 1; delivery <= 3; delivery++ {
		produced, err := handler(idempotencytest.NewMessage("order-1", nil))
		fmt.Printf("delivery %d: %d message(s) to the router, error: %v\n", delivery, len(produced), err != nil)
	}
	// Output:
	// billing order-1
	// delivery 1: 0 message(s) to the router, error: true
	// billing order-1
	// published to invoices: invoice for order-1
	// delivery 2: 0 message(s) to the router, error: false
	// delivery 3: 0 message(s) to the router, error: false
}
