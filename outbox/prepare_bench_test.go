package outbox

import (
	"context"
	"testing"
)

// BenchmarkPrepare is the client-side cost of one event in Add: defaults,
// checks, metadata and the size the relay's transport will count.
func BenchmarkPrepare(b *testing.B) {
	ctx := context.Background()
	payload := []byte(`{"order_id":"00000000-0000-0000-0000-000000000000","customer":"c-000000","currency":"EUR","items":[{"sku":"sku-0001","qty":1,"price":1999},{"sku":"sku-0002","qty":2,"price":599}],"note":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}`)
	ev := Event{Topic: "orders", AggregateType: "customer", AggregateID: "c-1", EventType: "order.created.v1", Payload: payload}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := defaultWriter().prepare(ctx, ev); err != nil {
			b.Fatal(err)
		}
	}
}
