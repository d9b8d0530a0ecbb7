package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
)

// The stuck gauge counts sagas stuck now: it stays up as long as a saga is
// stuck (the counter MetricStuck only says one became stuck) and goes down
// when an operator resolves it.
func TestStuckGaugeFollowsTheTable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{retry: retry.Policy{InitialInterval: 5 * time.Millisecond, MaxAttempts: 2, Jitter: retry.JitterNone}})
	o := b.startOrchestrator(t)
	require.Equal(t, 0.0, metricValue(t, o.reg, saga.MetricStuckNow, map[string]string{"type": "orders"}))
	b.parts.setDecide(func(_, step, phase string, _ int) action {
		if step == shipping || (step == charge && phase == saga.PhaseCompensation) {
			return fail
		}
		return succeed
	})
	b.start(t, o, "g1")
	b.start(t, o, "g2")
	b.waitState(t, "g1", saga.StateStuck)
	b.waitState(t, "g2", saga.StateStuck)
	require.Equal(t, 2.0, metricValue(t, o.reg, saga.MetricStuckNow, map[string]string{"type": "orders"}))
	n, err := saga.CountStuck(context.Background(), postgres.From(b.schema.DB), "orders")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)

	b.parts.setDecide(func(_, step, _ string, _ int) action {
		if step == shipping {
			return fail
		}
		return succeed
	})
	_, err = saga.Resolve(context.Background(), postgres.From(b.schema.DB), "g1", saga.ResolveRetry, "fixed", false)
	require.NoError(t, err)
	b.waitState(t, "g1", saga.StateCompensated)
	require.Equal(t, 1.0, metricValue(t, o.reg, saga.MetricStuckNow, map[string]string{"type": "orders"}), "g2 is still stuck")
	require.EqualValues(t, 2, metricValue(t, o.reg, saga.MetricStuck, map[string]string{"type": "orders"}), "the counter does not go down")
}

// Stopped is false until Close or Run's return; health.Orchestrator reads
// it with Running.
func TestStoppedAfterClose(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, defOpts{})
	o, err := saga.NewOrchestrator(postgres.From(b.schema.DB), b.def, saga.Config{ReplyTopic: b.tp.replies, PollInterval: 10 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	require.False(t, o.Stopped())
	done := make(chan error, 1)
	go func() { done <- o.Run(context.Background()) }()
	select {
	case <-o.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not start within 30s")
	}
	require.False(t, o.Stopped())
	require.NoError(t, o.Close())
	require.NoError(t, <-done)
	require.True(t, o.Stopped())

	// Run returning on its own (ctx ended) counts too.
	o2, err := saga.NewOrchestrator(postgres.From(b.schema.DB), b.def, saga.Config{ReplyTopic: b.tp.replies, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- o2.Run(ctx) }()
	select {
	case <-o2.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not start within 10s")
	}
	cancel()
	require.NoError(t, <-done)
	require.True(t, o2.Stopped())
}
