package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
)

// refusingPublisher refuses the events of one aggregate as a broker
// refuses a message too large for it, and counts its calls.
type refusingPublisher struct {
	calls int
}

func (p *refusingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.calls++
	return failure.Permanent(fmt.Errorf("kafka: publishing to %s: %w: kafka server: Message was too large", topic, transport.ErrMessageTooLarge))
}

func (p *refusingPublisher) Close() error { return nil }

// A publish error that no retry can fix (a broker's "too large" or
// "invalid name", marked failure.Permanent by the transports) fails the row
// at its first attempt, with its error in last_error and one log line,
// instead of spending the retry budget.
func TestRelay_PermanentPublishErrorFailsTheRowAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	ctx := context.Background()
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{}`)}))
	pub := &refusingPublisher{}
	logs := watermill.NewCaptureLogger()
	rel, err := relay.New(postgres.From(s.DB), pub, relay.Config{Logger: logs,
		Retry: retry.Policy{InitialInterval: time.Hour, MaxInterval: time.Hour, MaxAttempts: 20}})
	require.NoError(t, err)
	_, err = rel.RunOnce(ctx)
	require.NoError(t, err)
	var status, lastErr string
	var retries int
	require.NoError(t, s.DB.QueryRow(`SELECT status, retry_count, coalesce(last_error, '') FROM millwright_outbox`).Scan(&status, &retries, &lastErr))
	require.Equal(t, "failed", status, "a permanent error is final at once")
	require.Equal(t, 1, retries)
	require.Equal(t, 1, pub.calls)
	require.Contains(t, lastErr, "too large")
	logged := 0
	for _, e := range logs.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(e.Msg, "failed for good") {
			logged++
		}
	}
	require.Equal(t, 1, logged, "logged on its first occurrence")
}
