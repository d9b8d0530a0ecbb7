package storage

import (
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Placeholders are replaced outside quoted text only, and every value is
// quoted so that it cannot end its literal.
func TestInlineReplacesPlaceholdersOutsideQuotedText(t *testing.T) {
	for name, tc := range map[string]struct {
		sql  string
		args []any
		want string
	}{
		"plain":           {`SELECT $1, $2`, []any{"a", 2}, `SELECT 'a', 2`},
		"ten and one":     {`SELECT $10, $1`, []any{1, 2, 3, 4, 5, 6, 7, 8, 9, "ten"}, `SELECT 'ten', 1`},
		"in a string":     {`SELECT '$1', $1`, []any{"x"}, `SELECT '$1', 'x'`},
		"doubled quote":   {`SELECT 'it''s $1', $1`, []any{"x"}, `SELECT 'it''s $1', 'x'`},
		"escape string":   {`SELECT E'\' $1', $1`, []any{"x"}, `SELECT E'\' $1', 'x'`},
		"identifier":      {`SELECT "$1", $1`, []any{"x"}, `SELECT "$1", 'x'`},
		"line comment":    {"SELECT $1 -- $1\n, $1", []any{"x"}, "SELECT 'x' -- $1\n, 'x'"},
		"block comment":   {`SELECT /* $1 */ $1`, []any{"x"}, `SELECT /* $1 */ 'x'`},
		"dollar quote":    {`SELECT $$ $1 $$, $tag$ $1 $tag$, $1`, []any{"x"}, `SELECT $$ $1 $$, $tag$ $1 $tag$, 'x'`},
		"hostile value":   {`SELECT $1`, []any{`'); DROP TABLE x; --`}, `SELECT '''); DROP TABLE x; --'`},
		"backslash value": {`SELECT $1`, []any{`a\'b`}, `SELECT  E'a\\''b'`},
		"null and bytes":  {`SELECT $1, $2`, []any{nil, []byte{0xde, 0xad}}, `SELECT NULL,  E'\\xdead'::bytea`},
		"arrays":          {`SELECT $1, $2, $3`, []any{[]int64{1, 2}, []string{"a'"}, []int64{}}, `SELECT ARRAY[1,2]::bigint[], ARRAY['a''']::text[], '{}'::bigint[]`},
		"valuer":          {`SELECT $1, $2`, []any{sql.NullString{}, sql.NullInt64{Int64: 4, Valid: true}}, `SELECT NULL, 4`},
		"time and float":  {`SELECT $1, $2`, []any{time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC), 0.5}, `SELECT '2026-01-02 03:04:05.000006+00'::timestamptz, '0.5'::float8`},
		// Postgres reads neither year 0 nor an offset beyond ±15:59: the
		// instant goes in UTC, a year before 1 as BC, the fraction cut to
		// microseconds as pgx cuts it.
		"year 0 and +23:00": {`SELECT $1`, []any{time.Date(0, 3, 1, 12, 0, 0, 999, time.FixedZone("", 23*3600))}, `SELECT '0001-02-29 13:00:00.000000+00 BC'::timestamptz`},
		"year 10000":        {`SELECT $1`, []any{time.Date(10000, 1, 1, 0, 0, 0, 1_999, time.UTC)}, `SELECT '10000-01-01 00:00:00.000001+00'::timestamptz`},
		"float32":           {`SELECT $1`, []any{float32(0.1)}, `SELECT '0.10000000149011612'::float8`},
		"cast after param":  {`SELECT $1::jsonb`, []any{`{"a":1}`}, `SELECT '{"a":1}'::jsonb`},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := inline(Statement{SQL: tc.sql, Args: tc.args, Expect: NoExpect}, 0)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestInlineRefusesWhatItCannotQuote(t *testing.T) {
	for name, tc := range map[string]struct {
		sql  string
		args []any
		want string
	}{
		"missing argument":   {`SELECT $2`, []any{1}, "$2 in a statement with 1 argument"},
		"NUL byte":           {`SELECT $1`, []any{"a\x00b"}, "NUL byte"},
		"invalid UTF-8":      {`SELECT $1`, []any{"a\xffb"}, "not valid UTF-8 (byte 0xff at 1)"},
		"before 4714 BC":     {`SELECT $1`, []any{time.Date(-4714, 1, 1, 0, 0, 0, 0, time.UTC)}, "outside the range"},
		"unknown type":       {`SELECT $1`, []any{struct{}{}}, "cannot be sent"},
		"unterminated quote": {`SELECT "x, $1`, []any{1}, "unterminated identifier"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := inline(Statement{SQL: tc.sql, Args: tc.args, Expect: NoExpect}, 0)
			require.Error(t, err)
			require.True(t, strings.Contains(err.Error(), tc.want), "%v", err)
			if name == "NUL byte" || name == "invalid UTF-8" || name == "before 4714 BC" {
				require.ErrorIs(t, err, ErrUnstorable)
				var ve *ValueError
				require.ErrorAs(t, err, &ve)
				require.Equal(t, 1, ve.Arg)
			}
		})
	}
}
