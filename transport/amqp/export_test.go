package amqp

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// WaitConnected waits up to timeout for the publisher of a Transport to
// be connected (up) or disconnected (!up), and reports whether it got there.
func WaitConnected(pub message.Publisher, up bool, timeout time.Duration) bool {
	p := pub.(*publisher)
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		is, changed := p.state()
		if is == up {
			return true
		}
		select {
		case <-changed:
		case <-deadline.C:
			return false
		}
	}
}

// FreeChannels is how many of the publisher's pool slots are free: the
// pool size when no publish is running.
func FreeChannels(pub message.Publisher) int { return len(pub.(*publisher).slots) }

// BatchChannels is how many channels the publisher's last PublishBatch
// spread its messages over.
func BatchChannels(pub message.Publisher) int { return int(pub.(*publisher).lastLanes.Load()) }

// TooLarge is tooLarge, for tests.
var TooLarge = tooLarge

// ConnectError is connectError, for tests.
var ConnectError = connectError

// SetKeyedUnmarshal replaces how a KeyedSubscriber reads deliveries.
func SetKeyedUnmarshal(sub message.Subscriber, f func(amqp091.Delivery) (*message.Message, error)) {
	sub.(*KeyedSubscriber).unmarshal = f
}
