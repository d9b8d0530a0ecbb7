// Runs dlqtest.TestPoisonDoesNotBlock on every transport kind through the
// transport package, on the real brokers transporttest finds.
package dlq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

func TestPoisonDoesNotBlockAllTransports(t *testing.T) {
	t.Parallel()
	for _, kind := range transport.Kinds {
		name := string(kind)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			topic := fmt.Sprintf("poison_%s_%d", name, time.Now().UnixNano()%1e6)
			if kind == transport.AMQP {
				transporttest.DeleteAMQPTopology(t, []string{topic, dlq.DefaultTopic(topic)}, "dlqtest")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			tr, err := transport.Open(ctx, transporttest.Config(t, kind))
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })
			sub, err := tr.Subscriber("dlqtest")
			require.NoError(t, err)
			dlqtest.TestPoisonDoesNotBlock(t, tr.Publisher(), sub, topic)
			t.Logf("%s: %s", name, time.Since(start))
		})
	}
}
