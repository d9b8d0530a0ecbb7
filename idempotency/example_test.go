package idempotency_test

import (
	"fmt"

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
