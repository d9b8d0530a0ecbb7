package saga_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
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

// A participant is down past its step's timeout and past the first
// attempt of the step's compensation, then comes back, answers the
// compensations first (nothing to undo yet) and only then executes the
// command: the late success makes the orchestrator send the compensation
// again, once, and the effect is undone; the saga ends compensated, its
// reason still the timeout. Through every transport kind.
func TestLateSuccessOnEveryTransport(t *testing.T) {
	if testing.Short() {
		t.Skip("starts in-process Kafka and Pub/Sub and uses RabbitMQ; skipped with -short")
	}
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			testLateSuccessOnTransport(t, kind)
		})
	}
}

// lateOnTransportCause is the saga's cause in TestLateSuccessOnEveryTransport.
const lateOnTransportCause = `step "schedule_shipping" timed out after 1s`

func testLateSuccessOnTransport(t *testing.T, kind transport.Kind) {
	const cause = lateOnTransportCause
	b := setupLateOnTransport(t, kind)
	o := b.startOrchestrator(t)
	var down atomic.Bool
	down.Store(true)
	b.parts.setDecide(func(_, step, phase string, _ int) action {
		if step == shipping && (phase == saga.PhaseForward || down.Load()) {
			return hold
		}
		return succeed
	})
	b.start(t, o, "late")

	// The step timed out, then its compensation's first attempt.
	poll.Until(t, 30*time.Second, func() bool { return shippingTimeouts(t, b) == 2 },
		"the shipping step and its compensation time out")
	info, _, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "late")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(info.LastError, cause+`; then compensation of step "schedule_shipping" (attempt `), info.LastError)
	require.Equal(t, cause, info.Cause)

	// Shipping is back: it answers its compensations (nothing to
	// cancel yet), and the saga ends compensated.
	down.Store(false)
	_, err = b.parts.release("late", shipping, saga.PhaseCompensation, succeed)
	require.NoError(t, err)
	b.waitState(t, "late", saga.StateCompensated)
	// Then it schedules the shipment.
	n, err := b.parts.release("late", shipping, saga.PhaseForward, succeed)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	h := b.waitLateUndone(t, "late")

	// The undo's compensation has the same 1s timeout: on a slow
	// machine it may time out and be resent before its reply
	// arrives (the sql kind polls); the resent one's reply is then
	// a late reply. Those resends are the protocol working, so
	// they are folded away before comparing.
	require.Equal(t, []string{
		shipping + ":late_success", shipping + ":compensation", shipping + ":compensation_reply", ":compensated",
	}, foldResends(afterLate(h)))
	inPlace, applied, undone := b.parts.effect("late", shipping)
	require.False(t, inPlace, "the shipment is cancelled")
	require.Equal(t, 1, applied)
	require.Equal(t, 1, undone, "cancelled exactly once")
	requireLateCancellationLast(t, b)
	final, _, err := saga.Get(context.Background(), postgres.From(b.schema.DB), "late")
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, final.State)
	require.Equal(t, cause, final.LastError)
}

// setupLateOnTransport is a bundle on kind's transport whose shipping step
// and its compensation time out after 1s.
func setupLateOnTransport(t *testing.T, kind transport.Kind) *bundle {
	cfg := transport.Config{Kind: transport.SQL}
	if kind != transport.SQL {
		cfg = transporttest.Config(t, kind)
	}
	tp := newTopics()
	if kind == transport.AMQP {
		t.Cleanup(func() { deleteAMQP(t, tp) })
	}
	return setupTopics(t, &cfg, defOpts{
		cancelShipping: true,
		timeouts:       map[string]time.Duration{shipping: time.Second},
		compTimeouts:   map[string]time.Duration{shipping: time.Second},
		// Compensation attempts for a minute of 1s timeouts: with
		// the default five, a loaded machine (CI, sql polling) let
		// the saga go stuck before the test released the replies.
		retry: retry.Policy{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond, MaxAttempts: 60, Jitter: retry.JitterNone},
	}, tp)
}

// shippingTimeouts counts the shipping step's timeouts in the history of
// saga "late".
func shippingTimeouts(t *testing.T, b *bundle) int {
	h, err := saga.History(context.Background(), postgres.From(b.schema.DB), "late")
	require.NoError(t, err)
	n := 0
	for _, e := range h {
		if e.Step == shipping && e.Kind == saga.KindTimeout {
			n++
		}
	}
	return n
}

// requireLateCancellationLast: the refund and the release once each, then
// the cancellation, numbered after every earlier attempt; on a slow
// machine its 1s timeout may resend it (numbered on), which the
// participant's effect shows was applied once.
func requireLateCancellationLast(t *testing.T, b *bundle) {
	cmds := b.parts.commands("late")
	i := slices.Index(cmds, comp(charge, 1))
	require.Positive(t, i, "%v", cmds)
	require.GreaterOrEqual(t, len(cmds), i+3, "%v", cmds)
	want := []string{comp(charge, 1), comp(reserve, 1)}
	for k := range len(cmds) - i - 2 {
		want = append(want, comp(shipping, i-3+1+k))
	}
	require.Equal(t, want, cmds[i:], "%v", cmds)
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

// foldResends drops the timeouts of a compensation, the resent
// compensations that follow them and the late replies they cause from a
// history (see afterLate), leaving the sequence a fast run records.
func foldResends(h []string) []string {
	var out []string
	for _, e := range h {
		switch {
		case strings.HasSuffix(e, ":timeout"), strings.HasSuffix(e, ":late_reply"):
			continue
		case len(out) > 0 && out[len(out)-1] == e && strings.HasSuffix(e, ":compensation"):
			continue
		}
		out = append(out, e)
	}
	return out
}

// With Config.ReplyShards, commands name one of the orchestrator's reply
// topics, the same for every command of a saga, and sagas spread over
// all of them; the orchestrator, consuming each topic, completes and
// compensates them as with one. On sql, where a topic's replies are
// applied one at a time, that is what the shards are for.
func TestRepliesSpreadOverReplyShards(t *testing.T) {
	t.Parallel()
	const shards = 3
	b := setup(t, &transport.Config{Kind: transport.SQL}, defOpts{})
	b.replyShards = shards
	o := b.startOrchestrator(t)
	topics := o.o.ReplyTopics()
	require.Len(t, topics, shards)
	b.parts.setDecide(func(id, step, phase string, _ int) action {
		if strings.HasPrefix(id, "fails") && step == shipping && phase == saga.PhaseForward {
			return fail
		}
		return succeed
	})
	var ids []string
	for i := range 12 {
		id := fmt.Sprintf("ok-%d", i)
		if i%4 == 0 {
			id = fmt.Sprintf("fails-%d", i)
		}
		ids = append(ids, id)
		b.start(t, o, id)
	}
	used := map[string]int{}
	for _, id := range ids {
		want, steps := saga.StateCompleted, []string{fwd(reserve), fwd(charge), fwd(shipping)}
		if strings.HasPrefix(id, "fails") {
			want = saga.StateCompensated
			steps = append(steps, comp(charge, 1), comp(reserve, 1))
		}
		b.waitState(t, id, want)
		require.Equal(t, steps, b.parts.commands(id))
		replyTo := b.parts.command(id, reserve, saga.PhaseForward).Metadata.Get(metadata.SagaReplyTo)
		require.Contains(t, topics, replyTo)
		for _, step := range []string{charge, shipping} {
			require.Equal(t, replyTo, b.parts.command(id, step, saga.PhaseForward).Metadata.Get(metadata.SagaReplyTo),
				"saga %s: step %s replies elsewhere", id, step)
		}
		used[replyTo]++
	}
	require.Len(t, used, shards, "12 sagas all replied to %v", used)
}
