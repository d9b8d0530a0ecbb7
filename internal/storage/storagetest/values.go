package storagetest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("values", exerciseValues) }

// exerciseValues checks that every value a caller can hand the storage
// layer is stored as Postgres reads it, the same on both drivers, or
// refused before it is sent with an error naming the argument: the
// extremes of each argument type.
func exerciseValues(t *testing.T, setup func(t *testing.T) Setup) {
	t.Run("TimesAtTheExtremes", func(t *testing.T) { valuesTimesAtTheExtremes(t, setup) })

	t.Run("TimesOutsideTheRangeAreRefused", func(t *testing.T) { valuesTimesOutsideTheRangeAreRefused(t, setup) })

	t.Run("TextAtTheExtremes", func(t *testing.T) { valuesTextAtTheExtremes(t, setup) })

	t.Run("TextPostgresCannotStoreIsRefused", func(t *testing.T) { valuesTextPostgresCannotStoreIsRefused(t, setup) })

	t.Run("BytesAtTheExtremes", func(t *testing.T) { valuesBytesAtTheExtremes(t, setup) })

	t.Run("NumbersAtTheExtremes", func(t *testing.T) { valuesNumbersAtTheExtremes(t, setup) })

	t.Run("ErrorsNameTheirCause", func(t *testing.T) { valuesErrorsNameTheirCause(t, setup) })

	t.Run("RefusedDeadLetterNamesItsField", func(t *testing.T) { valuesRefusedDeadLetterNamesItsField(t, setup) })
}

// microsOf is t's microseconds since 2000 (Postgres' epoch: they fit an
// int64 over its whole range), cut as pgx cuts them (the fraction floored).
func microsOf(t time.Time) int64 {
	return (t.Unix()-946_684_800)*1_000_000 + int64(t.Nanosecond())/1000
}

func mustRFC3339(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	require.NoError(t, err)
	return v
}

// Times Go (and RFC 3339) hold that Postgres reads only in another form:
// year 0 and before (Postgres counts 1 BC, 2 BC, ...), years past 9999,
// offsets beyond ±15:59, nanoseconds. Each is stored as the instant it is,
// to the microsecond (the fraction cut as pgx cuts it), and reads back.
func valuesTimesAtTheExtremes(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	cases := map[string]time.Time{
		"year 1":               mustRFC3339(t, "0001-01-01T00:00:00Z"),
		"zero time.Time":       {},
		"year 9999":            mustRFC3339(t, "9999-12-31T23:59:59.999999Z"),
		"year 0000 (1 BC)":     mustRFC3339(t, "0000-01-01T00:00:00Z"),
		"year 0000 offset":     mustRFC3339(t, "0000-03-01T12:00:00+23:00"),
		"offset +23:00":        mustRFC3339(t, "2026-01-02T03:04:05.123456+23:00"),
		"offset -23:59":        mustRFC3339(t, "2026-01-02T03:04:05-23:59"),
		"offset +15:59":        mustRFC3339(t, "2026-01-02T03:04:05+15:59"),
		"offset +16:00":        mustRFC3339(t, "2026-01-02T03:04:05+16:00"),
		"local zone":           time.Date(2026, 3, 29, 2, 30, 0, 0, time.FixedZone("odd", 13*3600+45*60)),
		"nanoseconds":          time.Date(2026, 1, 2, 3, 4, 5, 999_999_999, time.UTC),
		"nanoseconds before 1": time.Date(0, 1, 1, 0, 0, 0, 1_999, time.UTC),
		"year 10000":           time.Date(10000, 1, 1, 0, 0, 0, 123_000, time.UTC),
		"first storable":       time.Date(-4713, 11, 24, 0, 0, 0, 0, time.UTC),
		"last storable":        time.Date(294276, 12, 31, 23, 59, 59, 999_999_999, time.UTC),
		"past pgx's overflow":  time.Date(294250, 6, 1, 0, 0, 0, 0, time.UTC),
	}
	id := int64(100)
	for name, at := range cases {
		id++
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, at) VALUES ($1, $2)`, id, at))
		require.NoError(t, err, "%s: %s", name, at)
		// The server's own reading, exactly (extract gives a numeric).
		var micros int64
		var got time.Time
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT (extract(epoch FROM at - '2000-01-01 00:00:00+00') * 1000000)::bigint, at FROM w WHERE id = $1`, id), &micros, &got), name)
		require.Equal(t, microsOf(at), micros, "%s: %s stored as another instant", name, at)
		require.Equal(t, microsOf(at), microsOf(got), "%s: %s read back as %s", name, at, got)
		// And the value finds its row as an argument of a comparison.
		var n int
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT count(*) FROM w WHERE id = $1 AND at = $2`, id, at), &n), name)
		require.Equal(t, 1, n, "%s: %s does not find its own row", name, at)
	}
}

// A time outside what both drivers store is refused before it is sent,
// naming the argument, and nothing is written: pgx wrapped a time past
// Postgres' range around to another instant (year 584000 was stored as
// 556 BC).
func valuesTimesOutsideTheRangeAreRefused(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	for name, at := range map[string]time.Time{
		"before 4714-11-24 BC": time.Date(-4713, 11, 23, 23, 59, 59, 999_999_999, time.UTC),
		"year -10000":          time.Date(-10000, 1, 1, 0, 0, 0, 0, time.UTC),
		"294277-01-01":         time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC),
		"year 584000":          time.Date(584000, 1, 1, 0, 0, 0, 0, time.UTC),
		"year 300000":          time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC),
	} {
		_, err := p.Exec(ctx, storage.Statement{SQL: `INSERT INTO w (id, at) VALUES ($1, $2)`, Args: []any{1, at}, Expect: storage.NoExpect, What: "the extreme time"})
		requireRefused(t, err, name, 2, "the extreme time", "outside the range", "22008")
		err = p.Batch(ctx, storage.S(`INSERT INTO w (id) VALUES (2)`), storage.S(`INSERT INTO w (id, at) VALUES ($1, $2)`, 3, at))
		var be *storage.BatchError
		require.ErrorAs(t, err, &be, name)
		require.Equal(t, 1, be.Index, "%s: the batch names the statement", name)
		requireRefused(t, err, name, 2, "", "outside the range", "22008")
	}
	requireRows(t, p, 0)
}

// requireRefused checks the refusal of a value before it was sent: it
// names the argument and why, and carries the SQLSTATE the server gives
// the same refusal (code), so that what classifies errors by their code
// (a retry decision) treats both alike.
func requireRefused(t *testing.T, err error, name string, arg int, what, reason, code string) {
	t.Helper()
	require.ErrorIs(t, err, storage.ErrUnstorable, "%s: %v", name, err)
	require.True(t, storage.IsDataError(err), "%s: a data error: %v", name, err)
	require.Equal(t, code, storage.Code(err), "%s: %v", name, err)
	require.True(t, storage.IsServerError(err), "%s: refused as the server refuses it, not a connection error: %v", name, err)
	var ve *storage.ValueError
	require.ErrorAs(t, err, &ve, name)
	require.Equal(t, arg, ve.Arg, "%s: %v", name, err)
	require.Contains(t, err.Error(), reason, name)
	if what != "" {
		require.Contains(t, err.Error(), what, "%s: the error names the statement", name)
	}
	require.NotContains(t, storage.Hint(err), "migrate", "%s: a refused value is not a missing migration", name)
}

func requireRows(t *testing.T, p storage.Pool, want int) {
	t.Helper()
	var n int
	require.NoError(t, p.QueryRow(context.Background(), storage.S(`SELECT count(*) FROM w`), &n))
	require.Equal(t, want, n)
}

// Text Postgres stores is stored as it is, the large and the odd.
func valuesTextAtTheExtremes(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	large := strings.Repeat("é'\\$1 ", 1<<17) // 1 MiB
	for i, s := range []string{"", "\uFFFD", "\u2028\u2029", "😀", "\x01\x7f", `\x00`, large} {
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, s, names) VALUES ($1, $2, $3)`, i, s, []string{s, ""}))
		require.NoError(t, err, "%q", s)
		var got string
		var names []string
		var octets int
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT s, names, octet_length(s) FROM w WHERE id = $1`, i), &got, storage.Array(&names), &octets))
		require.Equal(t, s, got)
		require.Equal(t, []string{s, ""}, names)
		require.Equal(t, len(s), octets)
	}
}

// Text Postgres cannot store (a NUL byte, invalid UTF-8), alone or in a
// text array, is refused before it is sent on both drivers, naming the
// argument and the byte, where the server would refuse it (SQLSTATE
// 22021) or database/sql would fail the whole query text.
func valuesTextPostgresCannotStoreIsRefused(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	for name, tc := range map[string]struct {
		args   []any
		arg    int
		reason string
	}{
		"NUL":                {[]any{1, "a\x00b", nil}, 2, "NUL byte (at byte 1)"},
		"invalid UTF-8":      {[]any{1, "ab\xffc", nil}, 2, "not valid UTF-8 (byte 0xff at 2)"},
		"truncated sequence": {[]any{1, "é"[:1], nil}, 2, "not valid UTF-8 (byte 0xc3 at 0)"},
		"NUL in an array":    {[]any{1, "ok", []string{"ok", "\x00"}}, 3, "NUL byte"},
		"binary in an array": {[]any{1, "ok", []string{"\xfe"}}, 3, "not valid UTF-8"},
	} {
		_, err := p.Exec(ctx, storage.Statement{SQL: `INSERT INTO w (id, s, names) VALUES ($1, $2, $3)`, Args: tc.args, Expect: storage.NoExpect, What: "the odd text"})
		requireRefused(t, err, name, tc.arg, "the odd text", tc.reason, "22021")
		err = p.Query(ctx, storage.S(`SELECT id FROM w WHERE s = $1 OR names = $2`, tc.args[1], tc.args[2]), func(storage.Row) error { return nil })
		requireRefused(t, err, name+" (query)", tc.arg-1, "", tc.reason, "22021")
	}
	requireRows(t, p, 0)
}

// Bytes are stored byte for byte: nil is NULL, empty is an empty value,
// every byte value and a large slice come back as they went.
func valuesBytesAtTheExtremes(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	every := make([]byte, 256)
	for i := range every {
		every[i] = byte(i)
	}
	large := make([]byte, 4<<20)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range large {
		large[i] = byte(r.Uint32())
	}
	for i, b := range [][]byte{nil, {}, {0}, every, large} {
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, b) VALUES ($1, $2)`, i, b))
		require.NoError(t, err)
		var isNull bool
		var size int
		var sum string
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT b IS NULL, coalesce(length(b), 0), coalesce(encode(sha256(b), 'hex'), '') FROM w WHERE id = $1`, i), &isNull, &size, &sum))
		require.Equal(t, b == nil, isNull, "slice %d: nil is NULL, and only nil", i)
		require.Equal(t, len(b), size)
		if b != nil {
			want := sha256.Sum256(b)
			require.Equal(t, hex.EncodeToString(want[:]), sum, "slice %d: the server holds other bytes", i)
		}
		var got []byte
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT b FROM w WHERE id = $1`, i), &got))
		require.Equal(t, b == nil, got == nil)
		require.True(t, string(b) == string(got), "slice %d read back changed", i)
	}
}

// Numbers are stored exactly: a float32 as the float8 of its exact value
// (as pgx sends it), the specials, the integer limits.
func valuesNumbersAtTheExtremes(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	for i, v := range []any{float32(0.1), float32(math.MaxFloat32), float32(math.SmallestNonzeroFloat32), 0.1, math.MaxFloat64,
		math.SmallestNonzeroFloat64, -math.MaxFloat64, math.Inf(1), math.Inf(-1), math.NaN(), math.Copysign(0, -1)} {
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, f) VALUES ($1, $2)`, i, v))
		require.NoError(t, err, "%v", v)
		want, ok := v.(float64)
		if !ok {
			want = float64(v.(float32))
		}
		var got float64
		var text string
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT f, f::text FROM w WHERE id = $1`, i), &got, &text))
		if math.IsNaN(want) {
			require.True(t, math.IsNaN(got), "NaN read back as %v", got)
			continue
		}
		require.Equal(t, math.Float64bits(want), math.Float64bits(got), "%v (%T) stored as %s", v, v, text)
	}
	// Postgres has no unsigned integer: one past bigint is refused, named.
	_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id) VALUES ($1)`, uint64(math.MaxInt64)))
	require.NoError(t, err)
	for _, v := range []any{uint64(math.MaxInt64) + 1, uint(math.MaxUint)} {
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id) VALUES ($1)`, v))
		requireRefused(t, err, "unsigned", 1, "", "past the range of bigint", "22003")
	}
	// A duration is an interval of its microseconds, cut toward zero on
	// both drivers.
	for _, d := range []time.Duration{0, 1500, -1500, time.Hour, math.MaxInt64, math.MinInt64} {
		var micros int64
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT (extract(epoch FROM $1::interval) * 1000000)::bigint`, d), &micros))
		require.Equal(t, d.Microseconds(), micros, "%s", d)
	}
	for i, v := range []int64{math.MinInt64, math.MaxInt64, 0, -1} {
		_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, ids) VALUES ($1, $2)`, 100+i, []int64{v}))
		require.NoError(t, err)
		var got []int64
		require.NoError(t, p.QueryRow(ctx, storage.S(`SELECT ids FROM w WHERE id = $1`, 100+i), storage.Array(&got)))
		require.Equal(t, []int64{v}, got)
	}
}

// A value the server refuses (a data exception, SQLSTATE class 22) is a
// data error, which no migration fixes; a missing table is.
func valuesErrorsNameTheirCause(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := wireTable(t, setup)
	_, err := p.Exec(ctx, storage.S(`INSERT INTO w (id, s) VALUES ($1, $2::varchar(2))`, 1, "abc"))
	require.NoError(t, err, "a cast cuts, it does not fail")
	for name, q := range map[string]storage.Statement{
		"datetime out of range": storage.S(`INSERT INTO w (id, at) VALUES (2, '0000-01-01 00:00:00+00')`),
		"zone out of range":     storage.S(`INSERT INTO w (id, at) VALUES (2, '2026-01-01 00:00:00+23:00')`),
		"integer out of range":  storage.S(`SELECT $1::bigint + 1`, int64(math.MaxInt64)),
		"division by zero":      storage.S(`SELECT 1 / 0`),
	} {
		_, err := p.Exec(ctx, q)
		require.Error(t, err, name)
		require.Equal(t, "22", storage.Code(err)[:2], "%s: %v", name, err)
		require.True(t, storage.IsDataError(err), "%s: %v", name, err)
		require.False(t, errors.Is(err, storage.ErrUnstorable), "%s: the server refused it, not the boundary", name)
		require.Contains(t, storage.Hint(err), "cannot store", name)
		require.NotContains(t, storage.Hint(err), "migrate", name)
	}
	_, err = p.Exec(ctx, storage.S(`INSERT INTO no_such_table VALUES (1)`))
	require.False(t, storage.IsDataError(err), "%v", err)
	require.Contains(t, storage.Hint(err), "did `millwright migrate` run?", "%v", err)
	_, err = p.Exec(ctx, storage.Statement{SQL: `UPDATE w SET s = 'x' WHERE id = 404`, Expect: 1})
	require.ErrorIs(t, err, storage.ErrConflict)
	require.False(t, storage.IsDataError(err), "a conflict is not a data error: %v", err)
	require.Empty(t, storage.Hint(err))
}

// A dead letter refused for a value names the column, so that the
// operator (and the dlq recorder's permanent error) knows which.
func valuesRefusedDeadLetterNamesItsField(t *testing.T, setup func(t *testing.T) Setup) {
	t.Parallel()
	ctx := context.Background()
	p := setup(t).Pool
	now := time.Now()
	_, err := storage.InsertDeadLetter(ctx, p, storage.DeadLetterRow{
		MessageUUID: "u-1", OriginalTopic: "orders", DLQTopic: "orders.dlq", Reason: "exhausted",
		FirstFailure: now, LastFailure: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC),
	})
	var ve *storage.ValueError
	require.ErrorAs(t, err, &ve, "%v", err)
	require.Equal(t, "last_failure_at", ve.Field)
	require.ErrorIs(t, err, storage.ErrUnstorable)
	require.Contains(t, err.Error(), "recording a dead letter: last_failure_at ($12): time 300000-01-01T00:00:00Z is outside the range")
	_, err = storage.InsertDeadLetter(ctx, p, storage.DeadLetterRow{
		MessageUUID: "u-2", OriginalTopic: "orders", DLQTopic: "orders.dlq", Reason: "exhausted", Error: "bad\xff",
		FirstFailure: now, LastFailure: now,
	})
	require.ErrorAs(t, err, &ve, "%v", err)
	require.Equal(t, "error", ve.Field)
	n, err := storage.CountDeadLetters(ctx, p, storage.DeadLetterFilter{})
	require.NoError(t, err)
	require.Zero(t, n)
}
