package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// recordFailure records the dead letter of err, as the middleware
// describes it (its Go type with %T), through RecordTx.
func recordFailure(t *testing.T, db postgres.DB, id, topic, handler string, err error, at time.Time) int64 {
	t.Helper()
	var out int64
	require.NoError(t, db.InTx(context.Background(), func(tx postgres.Tx) error {
		var e error
		out, e = dlq.RecordTx(context.Background(), tx, dlq.DeadLetter{MessageUUID: id, OriginalTopic: topic, DeadLetterTopic: dlq.DefaultTopic(topic),
			Handler: handler, Reason: dlq.ReasonExhausted, Error: err.Error(), ErrorType: fmt.Sprintf("%T", err), Attempts: 3,
			FirstFailure: at, LastFailure: at, Payload: []byte(`{}`)})
		return e
	}))
	return out
}

// Three dead letters of one Go type (errors.New's), two of one cause
// whose messages differ only in numbers, one of another: two causes, the
// first counting two, with its topics, first and last seen and newest
// sample. A row recorded before the fingerprint column (NULL there) joins
// its cause, and a filter by fingerprint finds it.
func TestCausesGroupByFingerprintNotGoType(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations())
	db := postgres.From(s.DB)
	ctx := context.Background()
	t0 := time.Now().UTC().Truncate(time.Second).Add(-time.Hour)
	a := recordFailure(t, db, "m1", "payments", "charge", errors.New("charging order 1841: card declined after 3 attempts"), t0)
	b := recordFailure(t, db, "m2", "refunds", "charge", errors.New("charging order 7: card declined after 12 attempts"), t0.Add(time.Minute))
	c := recordFailure(t, db, "m3", "payments", "charge", errors.New("ledger unavailable"), t0.Add(2*time.Minute))

	got, err := dlq.Causes(ctx, db, dlq.Filter{Pending: true})
	require.NoError(t, err)
	require.Len(t, got, 2, "two causes, not one *errors.errorString: %+v", got)
	declined, ledger := got[0], got[1]
	require.EqualValues(t, 2, declined.Count)
	require.EqualValues(t, 2, declined.Dead)
	require.Equal(t, []string{"payments", "refunds"}, declined.Topics)
	require.Equal(t, "*errors.errorString", declined.ErrorType)
	require.Equal(t, "charge", declined.Handler)
	require.Equal(t, "charging order <n>: card declined after <n> attempts", declined.Pattern)
	require.Equal(t, b, declined.SampleID, "the newest is the sample")
	require.Equal(t, "m2", declined.SampleUUID)
	require.True(t, declined.FirstSeen.Equal(t0) && declined.LastSeen.Equal(t0.Add(time.Minute)), "%v %v", declined.FirstSeen, declined.LastSeen)
	require.EqualValues(t, 1, ledger.Count)
	require.Equal(t, c, ledger.SampleID)
	require.NotEqual(t, declined.Fingerprint, ledger.Fingerprint)

	d, err := dlq.Get(ctx, db, a)
	require.NoError(t, err)
	require.Equal(t, declined.Fingerprint, d.Fingerprint, "stored with the dead letter")
	require.Equal(t, dlq.Fingerprint("charge", "*errors.errorString", "charging order 99: card declined after 1 attempts"), d.Fingerprint)
	require.Equal(t, []string{declined.Fingerprint}, pgtest.Column[string](t, s.DB, `SELECT fingerprint FROM millwright_dead_letters WHERE id = $1`, a))

	// An old row: no stored fingerprint.
	old := recordFailure(t, db, "m0", "payments", "charge", errors.New("charging order 5: card declined after 2 attempts"), t0.Add(-time.Hour))
	_, err = s.DB.Exec(`UPDATE millwright_dead_letters SET fingerprint = NULL WHERE id = $1`, old)
	require.NoError(t, err)
	got, err = dlq.Causes(ctx, db, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.EqualValues(t, 3, got[0].Count, "the old row joins its cause")
	require.True(t, got[0].FirstSeen.Equal(t0.Add(-time.Hour)))
	rows, err := dlq.List(ctx, db, dlq.Filter{Fingerprint: declined.Fingerprint})
	require.NoError(t, err)
	var ids []int64
	for _, r := range rows {
		ids = append(ids, r.ID)
		require.Equal(t, declined.Fingerprint, r.Fingerprint)
	}
	require.Equal(t, []int64{a, b, old}, ids)
	n, err := dlq.Count(ctx, db, dlq.Filter{Fingerprint: ledger.Fingerprint})
	require.NoError(t, err)
	require.Equal(t, 1, n)
}
