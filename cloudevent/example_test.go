package cloudevent_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
)

// OrderCreatedV1 is the first version of the event. Currency was added
// later as an optional field: old producers omit it, old consumers ignore
// it (encoding/json skips unknown fields), new consumers default it.
type OrderCreatedV1 struct {
	OrderID  string  `json:"order_id"`
	Amount   float64 `json:"amount"`
	Currency string  `json:"currency,omitempty"` // added later: optional
}

// OrderCreatedV2 is a breaking change: the amount becomes integer cents and
// the currency is required. It gets a new type, order.created.v2.
type OrderCreatedV2 struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// newEvent builds one message of a versioned type for an order.
func newEvent(id, version string, payload any) *message.Message {
	b, _ := json.Marshal(payload)
	msg := message.NewMessage(id, b)
	cloudevent.Attributes{
		ID: id, Source: "/orders-service", Type: "order.created." + version,
		Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Subject: "o-1", DataContentType: "application/json",
	}.Apply(msg)
	return msg
}

// Schema evolution in three steps: an optional field, v1 and v2 published
// side by side during a breaking change, consumers routed by version.
func Example_schemaEvolution() {
	// 1. Backward compatible: a v1 payload without the new optional field.
	var old OrderCreatedV1
	_ = json.Unmarshal([]byte(`{"order_id":"o-0","amount":9.5}`), &old)
	if old.Currency == "" {
		old.Currency = "USD" // the documented default for old events
	}
	fmt.Println("v1 without currency:", old.OrderID, old.Amount, old.Currency)

	// 2. Breaking change: the producer writes both versions of the event
	// (in one outbox transaction), each with its own event id.
	events := []*message.Message{
		newEvent("e-1-v1", "v1", OrderCreatedV1{OrderID: "o-1", Amount: 12.34, Currency: "EUR"}),
		newEvent("e-1-v2", "v2", OrderCreatedV2{OrderID: "o-1", AmountCents: 1234, Currency: "EUR"}),
	}

	// 3. Consumers routed by version. Each consumer handles the version it
	// understands and explicitly skips the other, so no order is handled
	// twice and no type is dropped silently.
	skip := func(who string) message.NoPublishHandlerFunc {
		return func(m *message.Message) error {
			fmt.Printf("%s: skips %s\n", who, m.Metadata.Get("ce_type"))
			return nil
		}
	}
	legacy := cloudevent.NewVersionRouter().
		Handle("order.created.v1", func(m *message.Message) error {
			var e OrderCreatedV1
			if err := json.Unmarshal(m.Payload, &e); err != nil {
				return failure.Permanent(err)
			}
			fmt.Printf("legacy: order %s amount %.2f %s\n", e.OrderID, e.Amount, e.Currency)
			return nil
		}).
		Handle("order.created.v2", skip("legacy"))
	migrated := cloudevent.NewVersionRouter().
		Handle("order.created.v1", skip("migrated")).
		Handle("order.created.v2", func(m *message.Message) error {
			var e OrderCreatedV2
			if err := json.Unmarshal(m.Payload, &e); err != nil {
				return failure.Permanent(err)
			}
			fmt.Printf("migrated: order %s amount %d cents %s\n", e.OrderID, e.AmountCents, e.Currency)
			return nil
		})
	for _, h := range []message.NoPublishHandlerFunc{legacy.Handler(), migrated.Handler()} {
		for _, e := range events {
			if err := h(e); err != nil {
				fmt.Println("error:", err)
			}
		}
	}

	// A version nobody handles yet fails permanently: the DLQ keeps it.
	err := migrated.Handler()(newEvent("e-2-v3", "v3", struct{}{}))
	fmt.Println("v3:", errors.Is(err, cloudevent.ErrUnknownType), failure.IsPermanent(err))

	// Output:
	// v1 without currency: o-0 9.5 USD
	// legacy: order o-1 amount 12.34 EUR
	// legacy: skips order.created.v2
	// migrated: skips order.created.v1
	// migrated: order o-1 amount 1234 cents EUR
	// v3: true true
}

// Validate names every attribute that is missing or malformed.
func ExampleValidate() {
	msg := message.NewMessage("m-1", nil)
	cloudevent.Attributes{ID: "e-1", Source: "/orders-service", Type: "order.created.v1"}.Apply(msg)
	fmt.Println(cloudevent.Validate(msg))
	msg.Metadata.Set("ce_time", "yesterday")
	fmt.Println(cloudevent.Validate(msg))
	// Output:
	// <nil>
	// cloudevent: message m-1: metadata ce_time "yesterday" is not an RFC 3339 timestamp (want e.g. 2026-01-02T15:04:05Z)
}
