package dlq_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/retry"
)

// failingPublisher refuses every publish.
type failingPublisher struct{}

func (failingPublisher) Publish(string, ...*message.Message) error { return errors.New("broker down") }
func (failingPublisher) Close() error                              { return nil }

// Stats counts dead letters by reason and failed dead-letter publishes,
// without a Registerer.
func TestStatsCountWithoutPrometheus(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pub.Close() })
	m, err := dlq.NewMiddleware(pub, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}})
	require.NoError(t, err)
	permanent := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, failure.Permanent(errors.New("bad order"))
	})
	panics := m.Middleware(func(*message.Message) ([]*message.Message, error) { panic("boom") })
	for range 2 {
		_, err := permanent(message.NewMessage(watermill.NewUUID(), nil))
		require.NoError(t, err, "dead-lettered, so acked")
	}
	_, err = panics(message.NewMessage(watermill.NewUUID(), nil))
	require.NoError(t, err)
	require.Equal(t, dlq.Stats{DeadLetters: 3, ByReason: map[string]uint64{dlq.ReasonPermanent: 2, dlq.ReasonPanic: 1}}, m.Stats())

	down, err := dlq.NewMiddleware(failingPublisher{}, dlq.Config{Retry: retry.Policy{MaxAttempts: 1}})
	require.NoError(t, err)
	_, err = down.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, failure.Permanent(errors.New("bad order"))
	})(message.NewMessage(watermill.NewUUID(), nil))
	require.Error(t, err, "nacked for redelivery")
	require.Equal(t, dlq.Stats{PublishFailures: 1, ByReason: map[string]uint64{}}, down.Stats())
}
