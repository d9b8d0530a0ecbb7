package dlq_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
)

// BenchmarkSuccessPath measures what the middleware adds to a handler that
// succeeds at once, against the bare handler as baseline. Run with
// -bench SuccessPath; compare the ns/op of the two sub-benchmarks.
func BenchmarkSuccessPath(b *testing.B) {
	h := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	msg := message.NewMessage("m", []byte("payload"))
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			_, _ = h(msg)
		}
	})
	b.Run("dlq", func(b *testing.B) {
		mw, err := dlq.NewMiddleware(&recordingPublisher{}, dlq.Config{})
		if err != nil {
			b.Fatal(err)
		}
		wrapped := mw.Middleware(h)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = wrapped(msg)
		}
	})
}
