package park_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/park"
)

// The default key is the ordering key the outbox sets (the Kafka key and
// Pub/Sub ordering key), else the aggregate.
func ExampleDefaultKey() {
	m := message.NewMessage("1", nil)
	m.Metadata.Set(metadata.AggregateType, "order")
	m.Metadata.Set(metadata.AggregateID, "o-42")
	fmt.Println(park.DefaultKey(m))
	m.Metadata.Set(metadata.OrderingKey, "order/o-42")
	fmt.Println(park.DefaultKey(m))
	// Output:
	// order/o-42
	// order/o-42
}
