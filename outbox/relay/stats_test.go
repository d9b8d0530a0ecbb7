package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

func TestRelay_StatsCountRoundsOutcomesAndLastSuccess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	brokerDown := true
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, m *message.Message) error {
		switch {
		case string(m.Payload) == `"poison"` && topic == "t":
			return errors.New("message too large")
		case brokerDown && topic == "t":
			return errors.New("broker down")
		}
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{DeadLetterTopic: "t.dead",
		Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 2}})
	require.NoError(t, err)
	require.Zero(t, r.LastSuccess(), "no round yet")
	require.Equal(t, Stats{}, r.Stats())

	before := time.Now()
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	require.False(t, r.LastSuccess().Before(before), "an empty round is a success")
	require.Equal(t, uint64(1), r.Stats().Rounds)

	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db),
		outbox.Event{Topic: "t", AggregateID: "bad", Payload: []byte(`"poison"`)},
		outbox.Event{Topic: "t", AggregateID: "ok", Payload: []byte(`"one"`)},
		outbox.Event{Topic: "t", AggregateID: "ok", Payload: []byte(`"two"`)}))
	last := r.LastSuccess()
	n, err = r.RunOnce(ctx)
	require.NoError(t, err, "failed publishes are recorded, not returned")
	require.Equal(t, 3, n)
	require.Equal(t, last, r.LastSuccess(), "a round whose publishes failed is no success")
	s := r.Stats()
	require.Equal(t, uint64(2), s.Retried, "the heads of both aggregates back off")
	require.Zero(t, s.Published)

	brokerDown = false
	// Wait out the 1ms backoff the failures scheduled.
	eventually(t, 30*time.Second, func() bool {
		_, err := r.RunOnce(ctx)
		return r.Stats().Failed == 1 && r.Stats().Published == 2 && err == nil
	}, "the poison row fails for good and the others go out")
	s = r.Stats()
	require.Equal(t, uint64(1), s.DeadLettered)
	require.Equal(t, uint64(2), s.Retried)
	require.Equal(t, 1, count(t, b.db, "status = 'failed'"))
	require.Equal(t, 2, count(t, b.db, "status = 'published'"))
	require.False(t, s.LastSuccess.Before(last))
	require.Greater(t, s.Rounds, uint64(2))
}
