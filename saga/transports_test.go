package saga_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	tramqp "github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// The happy path and a compensation, through every transport kind: the
// relay publishes commands and participants publish replies through the
// transport package, and the orchestrator consumes replies behind the
// idempotency middleware.
func TestEveryTransport(t *testing.T) {
	if testing.Short() {
		t.Skip("starts in-process Kafka and Pub/Sub and uses RabbitMQ; skipped with -short")
	}
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			// The broker named by MILLWRIGHT_TEST_* when set, else an
			// embedded one; setup points SQL at the test's schema.
			cfg := transport.Config{Kind: transport.SQL}
			if kind != transport.SQL {
				cfg = transporttest.Config(t, kind)
			}
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
		if err := tramqp.DeleteTopology(transporttest.AMQPURL(), []string{topic}, group); err != nil {
			t.Logf("cleanup: %v", err)
		}
	}
}
