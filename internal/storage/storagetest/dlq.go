package storagetest

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("dlq", exerciseDLQ) }

// dlAt is the dead letters' first failure.
var dlAt = time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)

func dlRow(uuid, topic, errText string, last time.Time) storage.DeadLetterRow {
	return storage.DeadLetterRow{
		MessageUUID: uuid, OriginalTopic: topic, DLQTopic: topic + ".dlq", ConsumerGroup: "g", Handler: "h",
		Reason: "error", Error: errText, ErrorType: "*errors.errorString", Attempts: 3,
		FirstFailure: dlAt, LastFailure: last, Payload: []byte{0, 'x', 0xff}, Metadata: `{"k": "v'q"}`,
	}
}

func dlInsert(t *testing.T, p storage.Pool, r storage.DeadLetterRow) int64 {
	t.Helper()
	id, err := storage.InsertDeadLetter(context.Background(), p, r)
	require.NoError(t, err)
	require.NotZero(t, id)
	return id
}

// exerciseDLQ checks the dead letters' operations.
func exerciseDLQ(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(*testing.T, Setup)
	}{
		{"InsertIsIdempotentAndGetRoundTrips", deadLettersInsertIsIdempotentAndGetRoundTrips},
		{"FiltersCountsAndRefs", deadLettersFiltersCountsAndRefs},
		{"ReplayLocksAndMarks", deadLettersReplayLocksAndMarks},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t))
		})
	}
}

func deadLettersInsertIsIdempotentAndGetRoundTrips(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	r := dlRow("u1", "orders", "boom", dlAt.Add(time.Second))
	id := dlInsert(t, p, r)
	again, err := storage.InsertDeadLetter(ctx, p, r)
	require.NoError(t, err)
	require.Zero(t, again, "the same dead letter is stored once")

	got, err := storage.GetDeadLetter(ctx, p, id)
	require.NoError(t, err)
	require.Equal(t, id, got.ID)
	require.Equal(t, "u1", got.MessageUUID)
	require.Equal(t, "orders.dlq", got.DLQTopic)
	require.Equal(t, 3, got.Attempts)
	require.True(t, got.LastFailure.Equal(r.LastFailure))
	require.Equal(t, []byte{0, 'x', 0xff}, got.Payload)
	require.JSONEq(t, `{"k": "v'q"}`, got.Metadata)
	require.Nil(t, got.ReplayedAt)
	require.False(t, got.CreatedAt.IsZero())

	require.Equal(t, "u1", got.MessageUUIDRaw, "a row without raw bytes reads its text's")
	require.Nil(t, got.MetadataRaw, "no metadata_raw given: NULL, Metadata is the copy")

	_, err = storage.GetDeadLetter(ctx, p, id+100)
	require.True(t, storage.IsNoRows(err), "a missing row: %v", err)

	// The lossless copies (dlq migration 005) round-trip every byte.
	bin := dlRow("u\uFFFD", "orders", "boom", dlAt.Add(2*time.Second))
	bin.MessageUUIDRaw = "u\xff\x00\n"
	md := map[string]string{"k\x00\xff": "v\x0a\xff\x01\x00", "": ""}
	bin.MetadataRaw = storage.EncodeParkedMetadata(md)
	binID := dlInsert(t, p, bin)
	got, err = storage.GetDeadLetter(ctx, p, binID)
	require.NoError(t, err)
	require.Equal(t, "u\xff\x00\n", got.MessageUUIDRaw)
	gotMD, err := got.MetadataMap()
	require.NoError(t, err)
	require.Equal(t, md, gotMD)
	refs, err := storage.ListDeadLetterRefs(ctx, p, storage.DeadLetterFilter{IDs: []int64{binID}})
	require.NoError(t, err)
	require.Equal(t, "u\xff\x00\n", refs[0].MessageUUID, "a replay's reference has the UUID's bytes")
	empty := dlRow("u-empty", "orders", "boom", dlAt.Add(3*time.Second))
	empty.MetadataRaw = []byte{}
	got, err = storage.GetDeadLetter(ctx, p, dlInsert(t, p, empty))
	require.NoError(t, err)
	require.NotNil(t, got.MetadataRaw, "empty metadata_raw is not NULL")
	gotMD, err = got.MetadataMap()
	require.NoError(t, err)
	require.Empty(t, gotMD, "empty metadata_raw is the metadata, not the JSON column")
}

func deadLettersFiltersCountsAndRefs(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	a := dlInsert(t, p, dlRow("a", "orders", "Connection REFUSED", dlAt))
	b := dlInsert(t, p, dlRow("b", "orders", "timeout", dlAt.Add(time.Hour)))
	c := dlInsert(t, p, dlRow("c", "billing", "refused again", dlAt.Add(2*time.Hour)))
	ids := func(f storage.DeadLetterFilter) []int64 {
		t.Helper()
		rows, err := storage.ListDeadLetters(ctx, p, f)
		require.NoError(t, err)
		var out []int64
		for _, r := range rows {
			out = append(out, r.ID)
		}
		n, err := storage.CountDeadLetters(ctx, p, f)
		require.NoError(t, err)
		if f.Limit == 0 {
			require.Equal(t, len(out), n, "Count agrees with List for %+v", f)
		}
		return out
	}
	require.Equal(t, []int64{a, b, c}, ids(storage.DeadLetterFilter{}))
	require.Equal(t, []int64{a, b}, ids(storage.DeadLetterFilter{Topic: "orders"}))
	require.Equal(t, []int64{a, c}, ids(storage.DeadLetterFilter{ErrorContains: "refused"}))
	require.Equal(t, []int64{c}, ids(storage.DeadLetterFilter{IDs: []int64{c, 999}}))
	require.Equal(t, []int64{b}, ids(storage.DeadLetterFilter{Since: dlAt.Add(time.Minute), Until: dlAt.Add(2 * time.Hour)}))
	require.Equal(t, []int64{b, c}, ids(storage.DeadLetterFilter{AfterID: a}))
	require.Equal(t, []int64{a}, ids(storage.DeadLetterFilter{Limit: 1}))
	n, err := storage.CountDeadLetters(ctx, p, storage.DeadLetterFilter{Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 3, n, "Count ignores Limit")

	refs, err := storage.ListDeadLetterRefs(ctx, p, storage.DeadLetterFilter{Topic: "billing"})
	require.NoError(t, err)
	require.Equal(t, []storage.DeadLetterRef{{ID: c, MessageUUID: "c", Topic: "billing", Error: "refused again"}}, refs)

	depth, err := storage.DeadLetterDepth(ctx, p)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"orders": 2, "billing": 1}, depth)
}

func deadLettersReplayLocksAndMarks(t *testing.T, st Setup) {
	ctx := context.Background()
	p := st.Pool
	id := dlInsert(t, p, dlRow("r", "orders", "boom", dlAt))

	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	d, ok, err := storage.LockDeadLetterForReplay(ctx, tx, id, false)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, []byte{0, 'x', 0xff}, d.Payload)

	other, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer other.Rollback(ctx)
	_, ok, err = storage.LockDeadLetterForReplay(ctx, other, id, true)
	require.NoError(t, err)
	require.False(t, ok, "a row locked by another replay is skipped, not waited for")
	require.NoError(t, other.Rollback(ctx))

	require.NoError(t, storage.MarkDeadLetterReplayed(ctx, tx, id))
	require.NoError(t, tx.Commit(ctx))

	got, err := storage.GetDeadLetter(ctx, p, id)
	require.NoError(t, err)
	require.NotNil(t, got.ReplayedAt)
	require.Equal(t, 1, got.ReplayCount)
	pending, err := storage.CountDeadLetters(ctx, p, storage.DeadLetterFilter{Pending: true})
	require.NoError(t, err)
	require.Zero(t, pending)
	depth, err := storage.DeadLetterDepth(ctx, p)
	require.NoError(t, err)
	require.Empty(t, depth)

	for _, force := range []bool{false, true} {
		tx, err := p.Begin(ctx, storage.TxOptions{})
		require.NoError(t, err)
		_, ok, err := storage.LockDeadLetterForReplay(ctx, tx, id, force)
		require.NoError(t, err)
		require.Equal(t, force, ok, "a replayed row is taken again only with force")
		require.NoError(t, tx.Rollback(ctx))
	}
}
