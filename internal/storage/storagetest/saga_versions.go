package storagetest

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

// sagaVersions checks the operations of saga definition versions
// (internal/storage/saga_versions.go).
func sagaVersions(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	fp := func(s string) sql.NullString { return sql.NullString{String: s, Valid: true} }
	due := time.Now().Add(-time.Second).Truncate(time.Microsecond)
	for _, in := range []struct {
		id, state string
		version   int
		fp        sql.NullString
	}{
		{"v1-a", "running", 1, fp("aaa")},
		{"v1-b", "running", 1, fp("bbb")}, // started on another graph of version 1
		{"v1-old", "running", 1, sql.NullString{}},
		{"v1-done", "completed", 1, fp("bbb")},
		{"v2-a", "compensating", 2, fp("ccc")},
		{"v3-a", "stuck", 3, fp("ddd")},
	} {
		s := newSaga(in.id, "orders")
		s.State, s.DefVersion, s.DefFingerprint, s.Deadline = in.state, in.version, in.fp, sql.NullTime{Time: due, Valid: true}
		ok, err := storage.InsertSaga(ctx, p, s, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
		require.NoError(t, err)
		require.True(t, ok)
	}
	got, err := storage.LockSaga(ctx, p, "v1-a")
	require.NoError(t, err)
	require.Equal(t, 1, got.DefVersion)
	require.Equal(t, fp("aaa"), got.DefFingerprint)

	others, err := storage.OtherSagaFingerprints(ctx, p, "orders", 1, "aaa")
	require.NoError(t, err)
	require.Equal(t, []storage.SagaFingerprintCount{{Fingerprint: "bbb", Count: 1}}, others, "live ones only; no fingerprint is not counted")
	vs, err := storage.OtherSagaVersions(ctx, p, "orders", []int64{1, 2})
	require.NoError(t, err)
	require.Equal(t, []storage.SagaVersionCount{{Version: 3, Count: 1}}, vs)

	claimed, err := storage.ClaimDueSagaVersions(ctx, p, "orders", []int64{1, 2}, []string{"aaa", "ccc"}, 10)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"v1-a", "v1-old", "v2-a"}, ids(claimed), "not v1-b nor v1-done (another graph) nor v3 (not run)")

	require.NoError(t, storage.RegisterSagaDefinition(ctx, p, "orders", 1, "aaa", "step reserve\n"))
	require.NoError(t, storage.RegisterSagaDefinition(ctx, p, "orders", 1, "aaa", "step reserve\n"))
	g, ok, err := storage.SagaDefinitionGraph(ctx, p, "orders", 1, "aaa")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "step reserve\n", g)
	_, ok, err = storage.SagaDefinitionGraph(ctx, p, "orders", 1, "zzz")
	require.NoError(t, err)
	require.False(t, ok)

	live, err := storage.LiveSagasOfVersion(ctx, p, "orders", 1)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"v1-a", "v1-b", "v1-old"}, ids(live))

	m := got
	m.DefVersion, m.DefFingerprint, m.Step, m.Data = 2, fp("ccc"), 2, []byte(`{"id":"v1-a","migrated":true}`)
	require.NoError(t, storage.MigrateSaga(ctx, p, m, got.Version, []storage.SagaStep{{Step: "charge", Kind: "migrated", Detail: "1 -> 2"}}))
	after, err := storage.LockSaga(ctx, p, "v1-a")
	require.NoError(t, err)
	require.Equal(t, 2, after.DefVersion)
	require.Equal(t, 2, after.Step)
	require.Equal(t, got.Version+1, after.Version)
	require.JSONEq(t, `{"id":"v1-a","migrated":true}`, string(after.Data))
	require.ErrorIs(t, storage.MigrateSaga(ctx, p, m, got.Version, nil), storage.ErrConflict, "written over a version it no longer has")

	rows, err := storage.SagaVersionStates(ctx, p)
	require.NoError(t, err)
	require.Contains(t, rows, storage.SagaVersionRow{Type: "orders", Version: 2, State: "running", Count: 1})
	defs, err := storage.SagaDefinitions(ctx, p)
	require.NoError(t, err)
	require.Len(t, defs, 1)
	info, err := storage.GetSaga(ctx, p, "v3-a")
	require.NoError(t, err)
	require.Equal(t, 3, info.DefVersion)
}
