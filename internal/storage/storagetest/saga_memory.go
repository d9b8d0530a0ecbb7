package storagetest

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("saga_memory", exerciseSagaMemory) }

// exerciseSagaMemory checks that the in-memory twins of the saga
// operations that saga's simulator uses (internal/storage/saga_memory.go)
// agree with the operations on the driver.
func exerciseSagaMemory(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(t *testing.T, p storage.Pool)
	}{
		{"InsertedSagaIsWhatInsertSagaStores", sagaInsertedIsStored},
		{"FactsOfAgreesWithLoadSagaFacts", sagaFactsOfAgrees},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t).Pool)
		})
	}
}

// sagaInsertedIsStored inserts an instance with every field set, and
// requires the row read back to be InsertedSaga's: a column InsertSaga
// starts writing must be added there too.
func sagaInsertedIsStored(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	in := newSaga("s-1", "orders")
	in.Version, in.CompAttempts, in.AttemptBase = 7, 2, 3
	in.CompStarted = sql.NullTime{Time: in.CreatedAt.Add(time.Second), Valid: true}
	in.LastError, in.Cause = sql.NullString{String: "last", Valid: true}, sql.NullString{String: "cause", Valid: true}
	in.ResumeStep = sql.NullInt64{Int64: 1, Valid: true}
	in.Branches, in.ForwardRetry = []byte(`{"pack": {"state": "running"}}`), true
	_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
	require.NoError(t, err)
	got, err := storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	want := storage.InsertedSaga(in)
	require.JSONEq(t, string(want.Data), string(got.Data))
	require.JSONEq(t, string(want.Branches), string(got.Branches))
	got.Data, want.Data, got.Branches, want.Branches = nil, nil, nil, nil
	got.CreatedAt, want.CreatedAt = got.CreatedAt.UTC(), want.CreatedAt.UTC()
	got.Deadline.Time, want.Deadline.Time = got.Deadline.Time.UTC(), want.Deadline.Time.UTC()
	require.Equal(t, want, got)
}

// sagaFactsOfAgrees asks LoadSagaFacts and SagaFactsOf the same questions
// of one history.
func sagaFactsOfAgrees(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	rows := []storage.SagaStep{
		{Step: "reserve", Kind: "command", Attempt: 1},
		{Step: "reserve", Kind: "reply", Attempt: 1},
		{Step: "charge", Kind: "compensation", Attempt: 1},
		{Step: "charge", Kind: "compensation", Attempt: 3},
		{Step: "reserve", Kind: "compensation", Attempt: 2},
		{Step: "charge", Kind: "late_success", Attempt: 1},
		{Step: "", Kind: "compensated"},
	}
	_, err := storage.InsertSaga(ctx, p, newSaga("s-1", "orders"), rows)
	require.NoError(t, err)
	for _, q := range []storage.SagaFactsQuery{
		{AnsweredStep: "charge", AnsweredKinds: []string{"reply", "late_success"}, AnsweredAttempt: 1, FinalKind: "compensated", AttemptKind: "compensation"},
		{AnsweredStep: "charge", AnsweredKinds: []string{"reply", "late_success"}, AnsweredAttempt: 2, FinalKind: "compensated", AttemptKind: "compensation"},
		{AnsweredStep: "reserve", AnsweredKinds: []string{"compensation_reply"}, AnsweredAttempt: 1, FinalKind: "stuck", AttemptKind: "reply"},
		{FinalKind: "late_success", AttemptKind: "command"},
		{},
	} {
		q.ID = "s-1"
		want, err := storage.LoadSagaFacts(ctx, p, q)
		require.NoError(t, err)
		require.Equal(t, want, storage.SagaFactsOf(rows, q), "%+v", q)
	}
}
