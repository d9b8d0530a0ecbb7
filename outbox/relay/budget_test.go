package relay

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// retryOnce fails a row at its first failure.
var retryOnce = retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 1}

// The default retry budget is what Config.Retry documents, 15
// minutes from the row's first failure, whatever the jitter draws: a row
// failing at every attempt, each attempt made when its backoff ends, is
// retried until its first failure is 15 minutes old and fails at the
// attempt made then, never earlier. Computed from the delays the relay's
// decision draws (a clock advanced by them), for many rows.
func TestRelay_DefaultRetryBudgetIsFifteenMinutes(t *testing.T) {
	t.Parallel()
	r, err := New(postgres.From(setup(t).db), noopPublisher{}, Config{})
	require.NoError(t, err)
	require.Equal(t, 15*time.Minute, DefaultRetryBudget)
	require.Equal(t, DefaultRetryBudget, r.cfg.Retry.MaxElapsedTime)
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var spans []time.Duration
	var attempts []int
	for range 2000 {
		now := start // the clock; the first attempt fails at start
		rw := row{}
		for {
			d, ok := r.retryAfter(rw, errors.New("broker down"), now)
			if !ok {
				break
			}
			require.Less(t, rw.retryCount, 100000, "the row is retried without end")
			rw.retryCount++
			now = now.Add(d)
			// The next claim: the database tells how long ago the first
			// failure was.
			rw.failing, rw.claimed = max(now.Sub(start), time.Microsecond), now
		}
		spans = append(spans, now.Sub(start))
		attempts = append(attempts, rw.retryCount+1)
	}
	slices.Sort(spans)
	slices.Sort(attempts)
	t.Logf("time from the first failure to the last: min %s, median %s, max %s; attempts: min %d, median %d, max %d",
		spans[0], spans[len(spans)/2], spans[len(spans)-1], attempts[0], attempts[len(attempts)/2], attempts[len(attempts)-1])
	require.GreaterOrEqual(t, spans[0], 15*time.Minute, "a row failed for good before its first failure was 15 minutes old")
	require.LessOrEqual(t, spans[len(spans)-1], 15*time.Minute+time.Millisecond, "the last attempt came after the budget had passed")
	// A permanent error fails the row at once.
	_, ok := r.retryAfter(row{}, failure.Permanent(errors.New("schema rejected")), start)
	require.False(t, ok)
}

// noopPublisher accepts everything.
type noopPublisher struct{}

func (noopPublisher) Publish(string, ...*message.Message) error { return nil }
func (noopPublisher) Close() error                              { return nil }

// The relay enforces the budget from the row's first failure as stored
// (first_failed_at), not from its attempts or its creation: a row that
// failed 25 times (more than the 20 attempts of the budget that counted
// attempts) in the last 10 minutes stays pending, its next attempt no
// later than 15 minutes after its first failure; a row whose first
// failure is 16 minutes old fails at its next failure; a row failing for
// the first time gets its first failure recorded; a permanent error fails
// the row at once. Rows written long ago are not failed early: the budget
// does not count from created_at.
func TestRelay_RetryBudgetCountsFromTheFirstFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for _, agg := range []string{"young", "old", "fresh", "permanent"} {
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: agg, Payload: []byte(`{}`)}))
	}
	_, err := b.schema.DB.Exec(`UPDATE millwright_outbox SET created_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	_, err = b.schema.DB.Exec(`UPDATE millwright_outbox SET retry_count = 25, first_failed_at = now() - interval '10 minutes' WHERE aggregate_id = 'young'`)
	require.NoError(t, err)
	_, err = b.schema.DB.Exec(`UPDATE millwright_outbox SET retry_count = 3, first_failed_at = now() - interval '16 minutes' WHERE aggregate_id = 'old'`)
	require.NoError(t, err)
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(_ string, m *message.Message) error {
		if m.Metadata.Get(metadata.AggregateID) == "permanent" {
			return failure.Permanent(errors.New("schema rejected"))
		}
		return errors.New("broker down")
	}}
	r, err := New(postgres.From(b.db), pub, Config{})
	require.NoError(t, err)
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, n)

	type state struct {
		status            string
		retries           int
		firstAge, nextDue time.Duration // before now; next attempt after the first failure
	}
	read := func(agg string) state {
		var s state
		var age, due float64
		require.NoError(t, b.schema.DB.QueryRow(`SELECT status, retry_count, extract(epoch FROM now() - first_failed_at),
			extract(epoch FROM next_attempt_at - first_failed_at) FROM millwright_outbox WHERE aggregate_id = $1`, agg).
			Scan(&s.status, &s.retries, &age, &due))
		s.firstAge, s.nextDue = time.Duration(age*float64(time.Second)), time.Duration(due*float64(time.Second))
		return s
	}
	young := read("young")
	require.Equal(t, "pending", young.status, "a row failing for 10 minutes failed for good before the 15-minute budget")
	require.Equal(t, 26, young.retries)
	require.InDelta(t, (10 * time.Minute).Seconds(), young.firstAge.Seconds(), 60, "its first failure was kept")
	require.LessOrEqual(t, young.nextDue, 15*time.Minute+time.Second, "its next attempt is after the budget")
	old := read("old")
	require.Equal(t, "failed", old.status, "a row failing for 16 minutes is still retried")
	require.InDelta(t, (16 * time.Minute).Seconds(), old.firstAge.Seconds(), 60)
	fresh := read("fresh")
	require.Equal(t, "pending", fresh.status)
	require.Equal(t, 1, fresh.retries)
	require.Less(t, fresh.firstAge, time.Minute, "the first failure was recorded now")
	require.Equal(t, "failed", read("permanent").status, "a permanent error did not fail the row at once")
}

// fault makes the statement recording a row failed for good fail once (a
// trigger on the outbox table raising an error the first time it fires;
// a sequence counts the firings, since it does not roll back with the
// failed statement). fired returns how often it fired.
func fault(t *testing.T, s *pgtest.Schema) (fired func() int) {
	t.Helper()
	_, err := s.DB.Exec(`CREATE SEQUENCE faults;
CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('faults') = 1 THEN
		RAISE EXCEPTION 'injected: recording the failure fails';
	END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER fail_once BEFORE UPDATE ON millwright_outbox FOR EACH ROW
	WHEN (NEW.status = 'failed') EXECUTE FUNCTION fail_once();`)
	require.NoError(t, err)
	return func() int {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM faults`).Scan(&n))
		return n
	}
}

// A row is dead-lettered once per failure even when the statement that
// records it failed does not commit the first time: the copy is sent
// after that statement, so the round whose statement failed sends none,
// and the next round, which fails the row again and records it, sends
// one. Counted at the dead-letter consumer.
func TestRelay_DeadLetterOnceWhenRecordingTheFailureFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	fired := fault(t, b.schema)
	dead := b.collect(t, "orders.dead")
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{}`)}))
	var attempts int
	pub := &hookPublisher{Publisher: b.pubsub, fail: func(topic string, _ *message.Message) error {
		if topic == "orders" {
			attempts++
			return errors.New("message too large")
		}
		return nil
	}}
	r, err := New(postgres.From(b.db), pub, Config{DeadLetterTopic: "orders.dead", Retry: retryOnce})
	require.NoError(t, err)

	_, err = r.RunOnce(ctx)
	require.ErrorContains(t, err, "injected: recording the failure fails", "the fault did not happen")
	require.Equal(t, 1, fired())
	require.Equal(t, 1, count(t, b.db, "status = 'pending' AND retry_count = 0"), "the failed statement changed the row")
	_, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, count(t, b.db, "status = 'failed'"))
	require.Equal(t, 2, attempts, "the row was not published twice")
	require.Equal(t, 2, fired(), "the second round did not record the failure")
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	require.Len(t, dead.all(), 1, "dead letters sent")
	var first time.Time
	require.NoError(t, b.db.QueryRow(`SELECT first_failed_at FROM millwright_outbox`).Scan(&first))
	require.Equal(t, first.UTC().Format(time.RFC3339Nano), dead.all()[0].Metadata.Get(metadata.DeadLetterFirstFailure),
		"the dead letter carries the row's first failure")
}
