package transport_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wgochannel "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/transport"
)

// BenchmarkPublishLayer isolates what transport adds to a publish (the
// name check and the wrapper) from broker time: both sides publish to an
// in-process GoChannel with no subscriber.
//
//	go test -run '^$' -bench PublishLayer -count 6 ./transport/ | benchstat -
func BenchmarkPublishLayer(b *testing.B) {
	payload := make([]byte, 300)
	msg := message.NewMessage(watermill.NewUUID(), payload)
	b.Run("watermill", func(b *testing.B) {
		ps := wgochannel.NewGoChannel(wgochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{})
		defer ps.Close()
		var pub message.Publisher = ps // applications hold the interface
		b.ReportAllocs()
		for b.Loop() {
			if err := pub.Publish("bench_topic", msg); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("millwright", func(b *testing.B) {
		cfg := transport.Config{Kind: transport.GoChannel}
		cfg.GoChannel.NotPersistent = true
		tr, err := transport.Open(context.Background(), cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer tr.Close()
		pub := tr.Publisher()
		b.ReportAllocs()
		for b.Loop() {
			if err := pub.Publish("bench_topic", msg); err != nil {
				b.Fatal(err)
			}
		}
	})
}
