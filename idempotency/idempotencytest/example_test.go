package idempotencytest_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
)

// NewMessage builds deliveries of one event for a handler test.
func ExampleNewMessage() {
	first := idempotencytest.NewMessage("evt-1", []byte(`{"amount":5}`))
	again := idempotencytest.NewMessage("evt-1", []byte(`{"amount":5}`))
	fmt.Println(first.Metadata.Get("ce_id"), again.Metadata.Get("ce_id"), first.UUID != again.UUID)

	dedup, _ := idempotency.NewMiddleware(idempotency.NewMemoryStore(),
		idempotency.Config{Consumer: "test", Registerer: prometheus.NewRegistry()})
	runs := 0
	h := dedup.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs++
		return nil, nil
	})
	_, _ = h(first)
	_, _ = h(again)
	fmt.Println("runs:", runs)
	// Output:
	// evt-1 evt-1 true
	// runs: 1
}
