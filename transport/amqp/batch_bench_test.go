package amqp_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// BenchmarkPublishBatch compares, on the test broker with the default
// pool of 8 channels, what the outbox relay does with a batch of n
// messages over n/6 aggregates (as in the relay bench: 6 events per aggregate): without PublishBatch, one Publish per
// aggregate from 8 goroutines (its PublishConcurrency); with it, one
// PublishBatch. Compare the msgs/s of the two in one run.
func BenchmarkPublishBatch(b *testing.B) {
	for _, n := range []int{100, 500} {
		msgs := keyed(n, n/6)
		b.Run(fmt.Sprintf("n=%d/Publish-per-key-x8", n), func(b *testing.B) {
			pub, topic := benchPublisher(b)
			byKey := map[string][]*message.Message{}
			for _, m := range msgs {
				k := m.Metadata.Get(metadata.OrderingKey)
				byKey[k] = append(byKey[k], m)
			}
			b.ResetTimer()
			for range b.N {
				work := make(chan []*message.Message, len(byKey))
				for _, ms := range byKey {
					work <- ms
				}
				close(work)
				var wg sync.WaitGroup
				for range 8 {
					wg.Go(func() {
						for ms := range work {
							if err := pub.Publish(topic, ms...); err != nil {
								b.Error(err)
							}
						}
					})
				}
				wg.Wait()
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
		b.Run(fmt.Sprintf("n=%d/PublishBatch", n), func(b *testing.B) {
			pub, topic := benchPublisher(b)
			bp := pub.(transport.BatchPublisher)
			b.ResetTimer()
			for range b.N {
				if err := bp.PublishBatch(topic, msgs...); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "msgs/s")
			b.ReportMetric(float64(amqp.BatchChannels(pub)), "channels")
		})
	}
}

func benchPublisher(b *testing.B) (message.Publisher, string) {
	b.Helper()
	tr, err := amqp.Open(context.Background(), amqp.Config{URL: transporttest.AMQPURL(), DeclareGroups: sink}, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = tr.Close() })
	topic := "mw_amqpbench_" + watermill.NewShortUUID()
	b.Cleanup(func() { _ = amqp.DeleteTopology(transporttest.AMQPURL(), []string{topic}, sink...) })
	return tr.Publisher(), topic
}
