package console_test

import (
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/kafka"
	"github.com/millwright/millwright/transport/lag"
	"github.com/millwright/millwright/transport/transporttest"
)

// A consumer group that consumed 10 messages of a topic, then had 1,000
// more produced behind it, is 1,000 behind: in the metric and on the
// console's Lag page, read from the real cluster (kfake without one).
func TestLagOfAConsumerGroupOnKafka(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := transporttest.Config(t, transport.Kafka)
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic, group := "lag-"+watermill.NewShortUUID(), "lag-group-"+watermill.NewShortUUID()

	publish := func(n int) {
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, i)))
		}
		require.NoError(t, tr.Publisher().(transport.BatchPublisher).PublishBatch(topic, msgs...))
	}
	publish(10)
	sub, err := tr.Subscriber(group)
	require.NoError(t, err)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 10 {
		select {
		case m := <-ch:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("the 10 messages were not consumed")
		}
	}

	r, err := kafka.NewLagReader(cfg.Kafka, kafka.LagConfig{Groups: []string{group}, Topics: []string{topic}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	total := func() (committed, behind int64) {
		ps, err := r.Lag(ctx)
		require.NoError(t, err)
		for _, p := range ps {
			committed += max(0, p.Committed)
			behind += p.Lag
		}
		return committed, behind
	}
	// Sarama commits the marked offsets every second: wait for the
	// commit of all 10, then stop consuming.
	poll.Until(t, time.Minute, func() bool { c, _ := total(); return c == 10 }, "the group's commit of its 10 messages")
	require.NoError(t, sub.Close())
	publish(1000)
	committed, behind := total()
	require.Equal(t, int64(10), committed)
	require.Equal(t, int64(1000), behind, "the group is 1,000 behind")

	// The metric.
	reg := prometheus.NewRegistry()
	reg.MustRegister(lag.NewCollector(r, lag.CollectorConfig{}))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var metric float64
	for _, mf := range mfs {
		if mf.GetName() != lag.MetricMessages {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			require.Equal(t, "kafka", labels["transport"])
			require.Equal(t, group, labels["group"])
			require.Equal(t, topic, labels["topic"])
			metric += m.GetGauge().GetValue()
		}
	}
	require.Equal(t, 1000.0, metric, "%s summed over the topic's partitions", lag.MetricMessages)

	// The page.
	b := setup(t, func(c *console.Config) { c.Lag = r })
	status, body := b.get(t, "/lag")
	require.Equal(t, 200, status, body)
	m := regexp.MustCompile(`kafka · ` + regexp.QuoteMeta(group) + ` · <span class="lag-total">(\d+)</span> behind`).FindStringSubmatch(body)
	require.NotNil(t, m, "the group's heading on the page:\n%s", body)
	require.Equal(t, "1000", m[1])
	require.Contains(t, body, `<td>`+topic+`</td>`)
}

// Without Config.Lag the page says how to configure it.
func TestLagPageNotConfigured(t *testing.T) {
	t.Parallel()
	b := setup(t)
	status, body := b.get(t, "/lag")
	require.Equal(t, 200, status, body)
	require.Contains(t, body, `id="lag-off"`)
}
