package saga_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	tramqp "github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
)

const amqpURL = "amqp://guest:guest@127.0.0.1:5672/"

// The happy path and a compensation, through every transport kind: the
// relay publishes commands and participants publish replies through the
// transport package, and the orchestrator consumes replies behind the
// idempotency middleware.
func TestEveryTransport(t *testing.T) {
	if testing.Short() {
		t.Skip("starts in-process Kafka and Pub/Sub and uses RabbitMQ; skipped with -short")
	}
	t.Parallel()
	configs := map[transport.Kind]func(t *testing.T) transport.Config{
		transport.GoChannel: func(*testing.T) transport.Config { return transport.Config{Kind: transport.GoChannel} },
		// setup points the SQL transport at the test's schema.
		transport.SQL: func(*testing.T) transport.Config { return transport.Config{Kind: transport.SQL} },
		transport.AMQP: func(*testing.T) transport.Config {
			c := transport.Config{Kind: transport.AMQP}
			c.AMQP.URL = amqpURL
			return c
		},
		transport.Kafka: func(t *testing.T) transport.Config {
			k, err := embedded.Kafka()
			require.NoError(t, err)
			t.Cleanup(func() { _ = k.Close() })
			return k.Config()
		},
		transport.GoogleCloud: func(t *testing.T) transport.Config {
			p, err := embedded.PubSub()
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			return p.Config()
		},
	}
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			cfg := configs[kind](t)
			tp := newTopics()
			if kind == transport.AMQP {
				// Cleanups run last in, first out: registered first, this
				// runs after the routers and the transport have closed.
				t.Cleanup(func() { deleteAMQP(t, tp) })
			}
			b := setupTopics(t, &cfg, defOpts{}, tp)
			o := b.startOrchestrator(t)
			b.parts.setDecide(func(id, step, phase string, _ int) action {
				if id == "fails" && step == shipping && phase == saga.PhaseForward {
					return fail
				}
				return succeed
			})
			b.start(t, o, "ok")
			b.start(t, o, "fails")
			b.waitState(t, "ok", saga.StateCompleted)
			b.waitState(t, "fails", saga.StateCompensated)
			require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping)}, b.parts.commands("ok"))
			require.Equal(t, []string{fwd(reserve), fwd(charge), fwd(shipping), comp(charge, 1), comp(reserve, 1)}, b.parts.commands("fails"))
		})
	}
}

// deleteAMQP removes the test's exchanges and queues from the shared server.
func deleteAMQP(t *testing.T, tp topics) {
	for _, topic := range tp.all() {
		group := "participant_" + topic
		if topic == tp.replies {
			group = "orders_saga"
		}
		if err := tramqp.DeleteTopology(amqpURL, []string{topic}, group); err != nil {
			t.Logf("cleanup: %v", err)
		}
	}
}
