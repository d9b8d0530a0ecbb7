package transport_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// TestConformanceKafkaKeyed runs Watermill's universal suite through the
// key-parallel Kafka consumer (KafkaConfig.KeyParallelism), with the
// Features of the default Kafka subscriber: nack redelivery, close and
// reconnect behave as there. The default group "test" selects it for
// every constructor (the key-parallel consumer needs a group).
func TestConformanceKafkaKeyed(t *testing.T) {
	t.Parallel()
	restart := reconnectCommand(t, transport.Kafka, "")
	pub, group := constructors(func(t *testing.T) transport.Config {
		c := transporttest.Config(t, transport.Kafka)
		c.Kafka.KeyParallelism = 8
		// TestMessageCtx wants a message's context cancelled within 30s of
		// Close while it is still unacked: that is the drain bound.
		c.Kafka.KeyDrainTimeout = 5 * time.Second
		return c
	}, "test")
	tests.TestPubSub(t, tests.Features{
		RestartServiceCommand: restart,
		ForceShort:            short(),
		ConsumerGroups:        true,
		ExactlyOnceDelivery:   false,
		GuaranteedOrder:       false,
		Persistent:            true,
	}, pub, group)
}

// TestConformanceAMQPKeyed runs Watermill's universal suite through the
// key-parallel RabbitMQ consumer (AMQPConfig.KeyParallelism), with the
// Features of the default AMQP subscriber.
func TestConformanceAMQPKeyed(t *testing.T) {
	t.Parallel()
	restart := reconnectCommand(t, transport.AMQP, "")
	pub, group := constructors(func(t *testing.T) transport.Config {
		c := transporttest.Config(t, transport.AMQP)
		c.AMQP.KeyParallelism = 8
		// TestMessageCtx wants a message's context cancelled within 30s of
		// Close while it is still unacked: that is the drain bound.
		c.AMQP.KeyDrainTimeout = 5 * time.Second
		return c
	}, "")
	tests.TestPubSub(t, tests.Features{
		RestartServiceCommand: restart,
		ForceShort:            short(),
		ConsumerGroups:        true,
		ExactlyOnceDelivery:   false,
		// Messages without an ordering key run concurrently.
		GuaranteedOrder:                     false,
		GuaranteedOrderWithSingleSubscriber: false,
		Persistent:                          true,
	}, pub, group)
}

// TestConformanceNATSKeyed runs Watermill's universal suite through the
// key-parallel NATS consumer (NATSConfig.KeyParallelism): messages without
// an ordering key run concurrently, so no order is declared.
func TestConformanceNATSKeyed(t *testing.T) {
	t.Parallel()
	restart := reconnectCommand(t, transport.NATS, "")
	pub, group := constructors(func(t *testing.T) transport.Config {
		c := transporttest.Config(t, transport.NATS)
		c.NATS.KeyParallelism = 8
		// TestMessageCtx wants a message's context cancelled within 30s of
		// Close while it is still unacked: that is the drain bound.
		c.NATS.KeyDrainTimeout = 5 * time.Second
		return c
	}, "test")
	tests.TestPubSub(t, tests.Features{
		RestartServiceCommand: restart,
		ForceShort:            short(),
		ConsumerGroups:        true,
		ExactlyOnceDelivery:   false,
		GuaranteedOrder:       false,
		Persistent:            true,
	}, pub, group)
}
