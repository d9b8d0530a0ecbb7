package storagetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/stretchr/testify/require"
)

func init() { Register("saga", exerciseSaga) }

// exerciseSaga checks the saga operations (internal/storage/saga.go).
func exerciseSaga(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(t *testing.T, p storage.Pool)
	}{
		{"InsertOnceWithHistoryInOrder", sagaInsertOnceWithHistoryInOrder},
		{"LockAndTransition", sagaLockAndTransition},
		{"Facts", sagaFacts},
		{"ClaimDueSkipsLockedAndOtherTypes", sagaClaimDueSkipsLockedAndOtherTypes},
		{"InfoListAndCount", sagaInfoListAndCount},
		{"Resolve", sagaResolve},
		{"ResolveForward", sagaResolveForward},
		{"CheckTables", sagaCheckTables},
		{"DataJSONBCannotHoldIsRefused", sagaDataJSONBCannotHoldIsRefused},
		{"CheckJSONBAgreesWithTheServer", checkJSONBAgreesWithTheServer},
		{"BranchesRoundTrip", sagaBranchesRoundTrip},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t).Pool)
		})
	}
}

func sagaInsertOnceWithHistoryInOrder(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	in := newSaga("s-1", "orders")
	ok, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{
		{Step: "reserve", Kind: "command", Detail: "reserve.v1", Attempt: 1},
		{Step: "it's", Kind: "note", Detail: `q"uote \ é`, Error: "boom"},
	})
	require.NoError(t, err)
	require.True(t, ok)
	h, err := storage.SagaHistory(ctx, p, "s-1")
	require.NoError(t, err)
	require.Len(t, h, 2)
	require.Equal(t, storage.SagaStep{Step: "reserve", Kind: "command", Detail: "reserve.v1", Attempt: 1}, h[0].SagaStep)
	require.Equal(t, storage.SagaStep{Step: "it's", Kind: "note", Detail: `q"uote \ é`, Error: "boom"}, h[1].SagaStep)
	var nullErrors int
	require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_saga_steps WHERE error IS NULL`), &nullErrors))
	require.Equal(t, 1, nullErrors, "an empty Error is stored as NULL")

	// The id exists: false, nothing written, the transaction goes on.
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	ok, err = storage.InsertSaga(ctx, tx, newSaga("s-1", "other"), []storage.SagaStep{{Step: "x", Kind: "command"}})
	require.NoError(t, err)
	require.False(t, ok)
	n, err := storage.CountSagas(ctx, tx, "orders", "running")
	require.NoError(t, err, "the transaction is usable")
	require.EqualValues(t, 1, n)
	h, err = storage.SagaHistory(ctx, tx, "s-1")
	require.NoError(t, err)
	require.Len(t, h, 2)

	_, err = storage.InsertSaga(ctx, p, newSaga("s-2", "orders"), nil)
	require.Error(t, err, "a saga starts with its history")
}

func sagaLockAndTransition(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	in := newSaga("s-1", "orders")
	_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
	require.NoError(t, err)
	_, err = storage.LockSaga(ctx, p, "missing")
	require.True(t, storage.IsNoRows(err), "err: %v", err)

	got, err := storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.EqualValues(t, 1, got.Version)
	require.Equal(t, "running", got.State)
	require.JSONEq(t, string(in.Data), string(got.Data))
	require.True(t, got.Deadline.Time.Equal(in.Deadline.Time))
	require.True(t, got.CreatedAt.Equal(in.CreatedAt))
	require.False(t, got.LastError.Valid)
	require.False(t, got.ResumeStep.Valid)

	next := got
	next.State, next.Step, next.Data = "compensating", -1, []byte(`{"id":"s-1","note":"it's"}`)
	next.Deadline, next.Awaiting, next.CompAttempts = sql.NullTime{}, false, 2
	next.CompStarted = sql.NullTime{Time: in.CreatedAt.Add(time.Second), Valid: true}
	next.LastError = sql.NullString{String: "it's broken", Valid: true}
	next.AttemptBase, next.ResumeStep = 3, sql.NullInt64{Int64: -1, Valid: true}
	next.Cause = sql.NullString{String: "cause", Valid: true}
	next.ForwardRetry = true
	history := []storage.SagaStep{{Step: "reserve", Kind: "reply", Attempt: 1}, {Step: "reserve", Kind: "compensation", Attempt: 4}}
	ss, err := storage.SagaTransition(next, 1, history)
	require.NoError(t, err)
	require.NoError(t, p.Batch(ctx, ss...))
	got, err = storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.EqualValues(t, 2, got.Version)
	want := next
	want.Version = 2
	got.CompStarted.Time, want.CompStarted.Time = got.CompStarted.Time.UTC(), want.CompStarted.Time.UTC()
	got.CreatedAt, want.CreatedAt = got.CreatedAt.UTC(), want.CreatedAt.UTC()
	require.JSONEq(t, string(want.Data), string(got.Data))
	got.Data, want.Data = nil, nil
	require.Equal(t, want, got)
	h, err := storage.SagaHistory(ctx, p, "s-1")
	require.NoError(t, err)
	require.Len(t, h, 3)

	// A stale version: a conflict, and the history after it is not
	// written.
	err = p.Batch(ctx, ss...)
	require.ErrorIs(t, err, storage.ErrConflict)
	var ce *storage.ConflictError
	require.True(t, errors.As(err, &ce))
	require.Zero(t, ce.Index)
	h, err = storage.SagaHistory(ctx, p, "s-1")
	require.NoError(t, err)
	require.Len(t, h, 3)

	// History alone.
	require.NoError(t, p.Batch(ctx, storage.SagaSteps("s-1", []storage.SagaStep{{Step: "charge", Kind: "duplicate", Attempt: 1}})))
	h, err = storage.SagaHistory(ctx, p, "s-1")
	require.NoError(t, err)
	require.Equal(t, "duplicate", h[3].Kind)
}

func sagaFacts(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	_, err := storage.InsertSaga(ctx, p, newSaga("s-1", "orders"), []storage.SagaStep{
		{Step: "charge", Kind: "compensation", Attempt: 1},
		{Step: "charge", Kind: "compensation", Attempt: 3},
		{Step: "reserve", Kind: "compensation", Attempt: 2},
		{Step: "charge", Kind: "late_success", Attempt: 1},
	})
	require.NoError(t, err)
	q := storage.SagaFactsQuery{ID: "s-1", AnsweredStep: "charge", AnsweredKinds: []string{"reply", "late_success"}, AnsweredAttempt: 1,
		FinalKind: "compensated", AttemptKind: "compensation"}
	f, err := storage.LoadSagaFacts(ctx, p, q)
	require.NoError(t, err)
	require.Equal(t, storage.SagaFacts{Answered: true, MaxAttempt: map[string]int{"charge": 3, "reserve": 2}}, f)
	q.AnsweredAttempt = 2
	f, err = storage.LoadSagaFacts(ctx, p, q)
	require.NoError(t, err)
	require.False(t, f.Answered)
	q.AnsweredKinds, q.FinalKind = nil, "late_success"
	f, err = storage.LoadSagaFacts(ctx, p, q)
	require.NoError(t, err)
	require.False(t, f.Answered, "no kinds: not asked")
	require.True(t, f.Final)
	f, err = storage.LoadSagaFacts(ctx, p, storage.SagaFactsQuery{ID: "missing", AttemptKind: "compensation"})
	require.NoError(t, err)
	require.Empty(t, f.MaxAttempt)
}

func sagaClaimDueSkipsLockedAndOtherTypes(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	now := time.Now()
	for i, s := range []struct {
		id, typ string
		due     time.Duration
	}{{"a", "orders", -3 * time.Second}, {"b", "orders", -2 * time.Second}, {"c", "orders", -time.Second}, {"d", "orders", time.Hour}, {"e", "other", -time.Hour}} {
		in := newSaga(s.id, s.typ)
		in.Deadline = sql.NullTime{Time: now.Add(s.due), Valid: true}
		_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "x", Kind: "command", Attempt: i}})
		require.NoError(t, err)
	}
	holder, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = storage.LockSaga(ctx, holder, "a")
	require.NoError(t, err)

	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	due, err := storage.ClaimDueSagas(ctx, tx, "orders", 10)
	require.NoError(t, err)
	require.Equal(t, []string{"b", "c"}, ids(due), "earliest first; a is locked, d not due, e another type")
	due, err = storage.ClaimDueSagas(ctx, holder, "orders", 1)
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, ids(due), "limit; the holder's own lock")
}

func sagaInfoListAndCount(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	base := time.Now().Add(-time.Hour)
	for i, id := range []string{"o-1", "o-2", "o-3"} {
		in := newSaga(id, "orders")
		in.CreatedAt = base.Add(time.Duration(i) * time.Minute)
		_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
		require.NoError(t, err)
	}
	require.NoError(t, p.Batch(ctx, storage.SagaSteps("o-2", []storage.SagaStep{
		{Step: "charge", Kind: "command", Attempt: 1}, {Step: "charge", Kind: "reply", Attempt: 1}})))
	_, err := p.Exec(ctx, storage.S(`UPDATE millwright_saga_instances SET state = 'stuck', last_error = 'x' WHERE id = 'o-3'`))
	require.NoError(t, err)

	all, err := storage.ListSagas(ctx, p, "", "", -1)
	require.NoError(t, err)
	require.Equal(t, []string{"o-3", "o-2", "o-1"}, infoIDs(all), "newest first")
	stuck, err := storage.ListSagas(ctx, p, "orders", "stuck", 10)
	require.NoError(t, err)
	require.Equal(t, []string{"o-3"}, infoIDs(stuck))
	one, err := storage.ListSagas(ctx, p, "orders", "", 1)
	require.NoError(t, err)
	require.Len(t, one, 1)
	none, err := storage.ListSagas(ctx, p, "other", "", 10)
	require.NoError(t, err)
	require.Empty(t, none)

	info, err := storage.GetSaga(ctx, p, "o-2")
	require.NoError(t, err)
	require.Equal(t, "charge", info.Step, "the newest command's step")
	require.JSONEq(t, `{"id":"o-2"}`, string(info.Data))
	require.True(t, info.Deadline.Valid)
	info, err = storage.GetSaga(ctx, p, "o-3")
	require.NoError(t, err)
	require.Equal(t, "x", info.LastError)
	require.Equal(t, "", info.Cause)
	_, err = storage.GetSaga(ctx, p, "missing")
	require.True(t, storage.IsNoRows(err), "err: %v", err)

	n, err := storage.CountSagas(ctx, p, "orders", "stuck")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

func sagaResolve(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	in := newSaga("s-1", "orders")
	in.State, in.Step, in.Deadline = "stuck", 1, sql.NullTime{}
	_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "charge", Kind: "stuck", Attempt: 3}})
	require.NoError(t, err)
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_saga_instances SET resume_step = 0, compensation_attempts = 3 WHERE id = 's-1'`))
	require.NoError(t, err)

	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = storage.LockSagaResume(ctx, tx, "missing")
	require.True(t, storage.IsNoRows(err), "err: %v", err)
	require.NoError(t, tx.Rollback(ctx))

	tx, err = p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	resume, err := storage.LockSagaResume(ctx, tx, "s-1")
	require.NoError(t, err)
	require.Equal(t, sql.NullInt64{Int64: 0, Valid: true}, resume)
	require.NoError(t, storage.ResolveSaga(ctx, tx, "s-1", 0, sql.NullInt64{}, storage.SagaStep{Step: "charge", Kind: "resolved", Detail: "skip: by hand", Attempt: 3}))
	require.NoError(t, tx.Commit(ctx))
	got, err := storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.Equal(t, "compensating", got.State)
	require.Zero(t, got.Step)
	require.Zero(t, got.CompAttempts)
	require.False(t, got.ResumeStep.Valid)
	require.False(t, got.Awaiting)
	require.True(t, got.Deadline.Valid, "due now")
	require.EqualValues(t, 2, got.Version)
	due, err := storage.ClaimDueSagas(ctx, p, "orders", 10)
	require.NoError(t, err)
	require.Equal(t, []string{"s-1"}, ids(due))
	h, err := storage.SagaHistory(ctx, p, "s-1")
	require.NoError(t, err)
	require.Equal(t, storage.SagaStep{Step: "charge", Kind: "resolved", Detail: "skip: by hand", Attempt: 3}, h[1].SagaStep)

	// A vanished instance is a conflict, not a silent no-op.
	err = storage.ResolveSaga(ctx, p, "missing", 0, sql.NullInt64{}, storage.SagaStep{Kind: "resolved"})
	require.ErrorIs(t, err, storage.ErrConflict)
}

func sagaCheckTables(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	info, err := storage.LookupTables(ctx, p, storage.SagaTables...)
	require.NoError(t, err)
	require.Empty(t, info.Missing)
	require.NotEmpty(t, info.Schema)
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, storage.S(`SET LOCAL search_path TO pg_catalog`))
	require.NoError(t, err)
	info, err = storage.LookupTables(ctx, tx, storage.SagaTables...)
	require.NoError(t, err)
	require.Equal(t, []string{"millwright_saga_instances", "millwright_saga_steps"}, info.Missing)
	require.Equal(t, "pg_catalog", info.Schema)
	require.Equal(t, "pg_catalog", info.SearchPath)
}

// newSaga is a running instance of typ, due in a minute.
func newSaga(id, typ string) storage.SagaInstance {
	now := time.Now().Truncate(time.Microsecond)
	return storage.SagaInstance{ID: id, Type: typ, State: "running", Step: 0, Data: []byte(`{"id":"` + id + `"}`),
		Deadline: sql.NullTime{Time: now.Add(time.Minute), Valid: true}, Awaiting: true, CreatedAt: now}
}

func ids(in []storage.SagaInstance) []string {
	out := []string{}
	for _, i := range in {
		out = append(out, i.ID)
	}
	return out
}

func infoIDs(in []storage.SagaInfoRow) []string {
	out := []string{}
	for _, i := range in {
		out = append(out, i.ID)
	}
	return out
}

// sagaDataJSONBCannotHoldIsRefused: saga data jsonb refuses (SQLSTATE 22P05 for the
// \u0000 escape, a lone surrogate, a number beyond numeric) is refused by
// InsertSaga and SagaTransition before any statement, naming the field,
// and the server refuses each of them too (the check is not stricter than
// Postgres); the extremes it accepts are stored and read back. Before,
// the server's error came back (on a transition: on every redelivery of
// the reply) and InsertSaga's caller was told to run `millwright migrate`.
func sagaDataJSONBCannotHoldIsRefused(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	serverRefuses := func(data string) bool {
		var s string
		return p.QueryRow(ctx, storage.S(`SELECT $1::text::jsonb::text`, data), &s) != nil
	}
	for _, c := range []struct{ data, field string }{
		{`{"id":"s","note":"a\u0000b"}`, `$.note holds the escape \u0000`},
		{`{"id":"s","items":[{"sku":"x"},{"sku":"\u0000"}]}`, `$.items[1].sku holds the escape \u0000`},
		{`{"a\u0000":1}`, `$ has a key that holds the escape \u0000`},
		{`{"odd key":{"x":"\ud800"}}`, `$["odd key"].x holds an unpaired UTF-16 surrogate`},
		{`{"x":"\udc00z"}`, `$.x holds an unpaired UTF-16 surrogate`},
		{`{"n":1e131072}`, `$.n is the number 1e131072`},
		{`{"n":100e131070}`, `$.n is the number 100e131070`},
		{`{"n":1e-16384}`, `$.n is the number 1e-16384`},
		{`{"n":0.5e-16383}`, `$.n is the number 0.5e-16383`},
		{`{"n":0e2000000000}`, `$.n is the number 0e2000000000`},
	} {
		require.True(t, serverRefuses(c.data), "the server refuses %s", c.data)
		in := newSaga("bad", "orders")
		in.Data = []byte(c.data)
		_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
		require.ErrorIs(t, err, storage.ErrJSONBRefuses, "%s", c.data)
		require.Contains(t, err.Error(), c.field)
		require.NotContains(t, err.Error(), "migrate")
		_, err = storage.SagaTransition(in, 1, nil)
		require.ErrorIs(t, err, storage.ErrJSONBRefuses, "%s", c.data)
		require.Contains(t, err.Error(), c.field)
	}
	n, err := storage.CountSagas(ctx, p, "orders", "running")
	require.NoError(t, err)
	require.Zero(t, n, "nothing refused was written")

	_, err = storage.InsertSaga(ctx, p, newSaga("nul\x00id", "orders"), []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
	require.ErrorContains(t, err, "holds a NUL byte")

	for i, data := range []string{
		`{"n":1e131071,"m":9.9e131071,"k":100e131069,"z":0.0e131072,"f":1e-16383}`,
		`{"s":"\\u0000 is text here","e":"\ud83d\ude00 \u00e9 \ufffd","q":"\"\/\b\f\n\r\t"}`,
		`{"\ud83d\ude00":[],"":{},"a b":[1,-0.5,true,false,null]}`,
	} {
		require.False(t, serverRefuses(data), "the server takes %s", data)
		require.NoError(t, storage.CheckJSONB([]byte(data)))
		in := newSaga(fmt.Sprintf("ok-%d", i), "orders")
		in.Data = []byte(data)
		ok, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}})
		require.NoError(t, err, "%s", data)
		require.True(t, ok)
		got, err := storage.LockSaga(ctx, p, in.ID)
		require.NoError(t, err)
		var same bool // jsonb's equality: Go's float64 cannot hold 1e131071
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT $1::text::jsonb = $2::text::jsonb`, data, string(got.Data)), &same))
		require.True(t, same, "stored %s, read %s", data, got.Data)
		ss, err := storage.SagaTransition(got, got.Version, nil)
		require.NoError(t, err)
		require.NoError(t, p.Batch(ctx, ss...))
	}
}

// checkJSONBAgreesWithTheServer: CheckJSONB accepts exactly what the
// server's jsonb accepts, over generated JSON mixing the escapes and
// numbers at jsonb's bounds with ordinary values.
func checkJSONBAgreesWithTheServer(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	rnd := rand.New(rand.NewSource(40))
	strs := []string{`a`, `\u0000`, `\\u0000`, `\ud800`, `\udc00`, `\ud83d\ude00`, `\ud800\u0041`, `\ud800\ud800`,
		`\udbff\udfff`, `\u00e9`, `\n\"`, `é`, `\ud800\n`, `x\\`}
	nums := []string{`0`, `-1.5`, `1e131071`, `1e131072`, `9.99e131071`, `10e131071`, `1e-16383`, `1e-16384`, `0.1e-16382`,
		`0.1e-16383`, `0e-16384`, `0e2000000000`, `0.000e131075`, `123.456e-16380`, `1E+5`, `-0`, `5e1073741822`}
	var gen func(depth int) string
	gen = func(depth int) string {
		switch k := rnd.Intn(6); {
		case k == 0 && depth < 3:
			n := rnd.Intn(3)
			parts := make([]string, n)
			for i := range parts {
				parts[i] = `"` + strs[rnd.Intn(len(strs))] + `":` + gen(depth+1)
			}
			return "{" + strings.Join(parts, ",") + "}"
		case k == 1 && depth < 3:
			n := rnd.Intn(3)
			parts := make([]string, n)
			for i := range parts {
				parts[i] = gen(depth + 1)
			}
			return "[" + strings.Join(parts, ", ") + "]"
		case k <= 3:
			return `"` + strs[rnd.Intn(len(strs))] + strs[rnd.Intn(len(strs))] + `"`
		case k == 4:
			return nums[rnd.Intn(len(nums))]
		default:
			return []string{"true", "false", "null"}[rnd.Intn(3)]
		}
	}
	accepted, refused := 0, 0
	for i := 0; i < 300; i++ {
		data := gen(0)
		var s string
		serverTakes := p.QueryRow(ctx, storage.S(`SELECT $1::text::jsonb::text`, data), &s) == nil
		err := storage.CheckJSONB([]byte(data))
		require.Equal(t, serverTakes, err == nil, "%s: CheckJSONB says %v", data, err)
		if serverTakes {
			accepted++
		} else {
			refused++
		}
	}
	require.Positive(t, accepted)
	require.Positive(t, refused)
}

// sagaBranchesRoundTrip: the branches column (parallel branches' states)
// is written by InsertSaga and SagaTransition and read by LockSaga,
// ClaimDueSagas and GetSaga; nil is NULL.
func sagaBranchesRoundTrip(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	in := newSaga("s-1", "orders")
	in.Branches = []byte(`{"a":{"state":"running","deadline":"2026-12-06T10:00:00Z"},"b":{"state":"running"}}`)
	_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "a", Kind: "command", Attempt: 1}, {Step: "b", Kind: "command", Attempt: 1}})
	require.NoError(t, err)
	got, err := storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.JSONEq(t, string(in.Branches), string(got.Branches))

	next := got
	next.Branches = []byte(`{"a":{"state":"succeeded"},"b":{"state":"timed_out","late_success":true}}`)
	ss, err := storage.SagaTransition(next, got.Version, nil)
	require.NoError(t, err)
	require.NoError(t, p.Batch(ctx, ss...))
	info, err := storage.GetSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.JSONEq(t, string(next.Branches), string(info.Branches))

	got, err = storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	got.Branches = nil
	ss, err = storage.SagaTransition(got, got.Version, nil)
	require.NoError(t, err)
	require.NoError(t, p.Batch(ctx, ss...))
	got, err = storage.LockSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.Nil(t, got.Branches, "nil is NULL")
	info, err = storage.GetSaga(ctx, p, "s-1")
	require.NoError(t, err)
	require.Nil(t, info.Branches)
}

// sagaResolveForward: a saga stuck on a Retriable step's command
// (forward_retry) is handed back running, due now: retry keeps
// forward_retry and starts a round numbered after the earlier attempts;
// skip clears it.
func sagaResolveForward(t *testing.T, p storage.Pool) {
	ctx := context.Background()
	for _, retry := range []bool{true, false} {
		id := fmt.Sprintf("f-%v", retry)
		in := newSaga(id, "orders")
		in.State, in.Step, in.Deadline = "stuck", 2, sql.NullTime{}
		_, err := storage.InsertSaga(ctx, p, in, []storage.SagaStep{{Step: "charge", Kind: "stuck", Attempt: 3}})
		require.NoError(t, err)
		fwd, err := storage.SagaForwardRetry(ctx, p, id)
		require.NoError(t, err)
		require.False(t, fwd, "false by default")
		_, err = p.Exec(ctx, storage.S(`UPDATE millwright_saga_instances SET forward_retry = true, compensation_attempts = 3,
			compensation_attempt_base = 1, compensation_started_at = now() WHERE id = $1`, id))
		require.NoError(t, err)
		fwd, err = storage.SagaForwardRetry(ctx, p, id)
		require.NoError(t, err)
		require.True(t, fwd)

		require.NoError(t, storage.ResolveSagaForward(ctx, p, id, retry, storage.SagaStep{Step: "charge", Kind: "resolved", Detail: "by hand", Attempt: 3}))
		got, err := storage.LockSaga(ctx, p, id)
		require.NoError(t, err)
		require.Equal(t, "running", got.State)
		require.Equal(t, 2, got.Step)
		require.False(t, got.Awaiting)
		require.True(t, got.Deadline.Valid, "due now")
		require.Equal(t, retry, got.ForwardRetry)
		require.Zero(t, got.CompAttempts)
		require.False(t, got.CompStarted.Valid)
		require.Equal(t, 4, got.AttemptBase, "after the 3 attempts of the round")
		h, err := storage.SagaHistory(ctx, p, id)
		require.NoError(t, err)
		require.Equal(t, "resolved", h[1].Kind)
	}
	_, err := storage.SagaForwardRetry(ctx, p, "missing")
	require.True(t, storage.IsNoRows(err), "err: %v", err)
	err = storage.ResolveSagaForward(ctx, p, "missing", true, storage.SagaStep{Kind: "resolved"})
	require.ErrorIs(t, err, storage.ErrConflict)
}
