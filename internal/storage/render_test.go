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
		"plain":            {`SELECT $1, $2`, []any{"a", 2}, `SELECT 'a', 2`},
		"ten and one":      {`SELECT $10, $1`, []any{1, 2, 3, 4, 5, 6, 7, 8, 9, "ten"}, `SELECT 'ten', 1`},
		"in a string":      {`SELECT '$1', $1`, []any{"x"}, `SELECT '$1', 'x'`},
		"doubled quote":    {`SELECT 'it''s $1', $1`, []any{"x"}, `SELECT 'it''s $1', 'x'`},
		"escape string":    {`SELECT E'\' $1', $1`, []any{"x"}, `SELECT E'\' $1', 'x'`},
		"identifier":       {`SELECT "$1", $1`, []any{"x"}, `SELECT "$1", 'x'`},
		"line comment":     {"SELECT $1 -- $1\n, $1", []any{"x"}, "SELECT 'x' -- $1\n, 'x'"},
		"block comment":    {`SELECT /* $1 */ $1`, []any{"x"}, `SELECT /* $1 */ 'x'`},
		"dollar quote":     {`SELECT $$ $1 $$, $tag$ $1 $tag$, $1`, []any{"x"}, `SELECT $$ $1 $$, $tag$ $1 $tag$, 'x'`},
		"hostile value":    {`SELECT $1`, []any{`'); DROP TABLE x; --`}, `SELECT '''); DROP TABLE x; --'`},
		"backslash value":  {`SELECT $1`, []any{`a\'b`}, `SELECT  E'a\\''b'`},
		"null and bytes":   {`SELECT $1, $2`, []any{nil, []byte{0xde, 0xad}}, `SELECT NULL,  E'\\xdead'::bytea`},
		"arrays":           {`SELECT $1, $2, $3`, []any{[]int64{1, 2}, []string{"a'"}, []int64{}}, `SELECT ARRAY[1,2]::bigint[], ARRAY['a''']::text[], '{}'::bigint[]`},
		"valuer":           {`SELECT $1, $2`, []any{sql.NullString{}, sql.NullInt64{Int64: 4, Valid: true}}, `SELECT NULL, 4`},
		"time and float":   {`SELECT $1, $2`, []any{time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC), 0.5}, `SELECT '2026-01-02 03:04:05.000006Z'::timestamptz, '0.5'::float8`},
		"cast after param": {`SELECT $1::jsonb`, []any{`{"a":1}`}, `SELECT '{"a":1}'::jsonb`},
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
		"unknown type":       {`SELECT $1`, []any{struct{}{}}, "cannot be sent"},
		"unterminated quote": {`SELECT "x, $1`, []any{1}, "unterminated identifier"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := inline(Statement{SQL: tc.sql, Args: tc.args, Expect: NoExpect}, 0)
			require.Error(t, err)
			require.True(t, strings.Contains(err.Error(), tc.want), "%v", err)
		})
	}
}
