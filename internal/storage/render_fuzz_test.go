package storage

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// unquote reads one Postgres string literal as literal writes it (quotes
// doubled inside; the E form, with backslashes doubled too, when it holds
// a backslash) and returns its value and what follows it.
func unquote(t *testing.T, lit string) (string, string) {
	t.Helper()
	escapes := strings.HasPrefix(lit, " E'")
	if escapes {
		lit = lit[2:]
	}
	if !strings.HasPrefix(lit, "'") {
		t.Fatalf("not a literal: %q", lit)
	}
	var b strings.Builder
	for i := 1; i < len(lit); i++ {
		switch c := lit[i]; {
		case c == '\'' && i+1 < len(lit) && lit[i+1] == '\'':
			b.WriteByte('\'')
			i++
		case c == '\'':
			return b.String(), lit[i+1:]
		case c == '\\' && escapes:
			if i+1 >= len(lit) {
				t.Fatalf("dangling backslash in %q", lit)
			}
			b.WriteByte(lit[i+1])
			i++
		default:
			b.WriteByte(c)
		}
	}
	t.Fatalf("unterminated literal %q", lit)
	return "", ""
}

// A value inlined into a statement stays inside its literal whatever it
// holds, and reads back as itself; the text around the placeholder, with
// another placeholder inside quotes, is left as it was.
func FuzzInline(f *testing.F) {
	for _, s := range []string{"", "plain", "a\xffb", "\x00", "it's", `back\slash`, `\'`, "'; DROP TABLE t; --", "$1", "$$", "é\u2028", "E'x'"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		if strings.IndexByte(v, 0) >= 0 || !utf8.ValidString(v) {
			if _, err := inline(Statement{SQL: `SELECT $1`, Args: []any{v}, Expect: NoExpect}, 0); !errors.Is(err, ErrUnstorable) {
				t.Fatalf("text Postgres cannot store (a NUL byte or invalid UTF-8) was not refused: %v", err)
			}
			return
		}
		q, err := inline(Statement{SQL: `SELECT '$1', $1 -- $1`, Args: []any{v}, Expect: NoExpect}, 0)
		if err != nil {
			t.Fatal(err)
		}
		const pre, post = `SELECT '$1', `, ` -- $1`
		if !strings.HasPrefix(q, pre) || !strings.HasSuffix(q, post) {
			t.Fatalf("text around the placeholder changed: %q", q)
		}
		got, rest := unquote(t, q[len(pre):len(q)-len(post)])
		if got != v || rest != "" {
			t.Fatalf("inlined %q read back as %q, then %q", v, got, rest)
		}
	})
}

// A time inlined is the instant it was, to the microsecond (the fraction
// cut as pgx cuts it), whatever its year and offset: read back as
// Postgres reads the literal (UTC, BC for the years before 1).
func FuzzTimeLiteral(f *testing.F) {
	f.Add(int64(0), int64(0), 0)
	f.Add(int64(-62167219200), int64(999), 23*3600)          // year 0, +23:00
	f.Add(int64(253402300799), int64(999_999_999), -86399)   // 9999-12-31T23:59:59, -23:59:59
	f.Add(int64(-210866803200), int64(0), 0)                 // 4714-11-24 BC
	f.Add(int64(9224318015999), int64(999_999_999), 15*3600) // the last storable second, 294276-12-31T23:59:59Z
	f.Fuzz(func(t *testing.T, sec, nsec int64, offset int) {
		at := time.Unix(sec, nsec%1_000_000_000).In(time.FixedZone("", offset%(24*3600)))
		lit, err := timeLiteral(at)
		if CheckTime(at) != nil {
			if !errors.Is(err, ErrUnstorable) {
				t.Fatalf("%s outside the range was rendered as %s", at, lit)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		text, ok := strings.CutPrefix(lit, "'")
		if !ok {
			t.Fatalf("not a literal: %s", lit)
		}
		text, ok = strings.CutSuffix(text, "'::timestamptz")
		if !ok {
			t.Fatalf("not a timestamptz: %s", lit)
		}
		bc := strings.HasSuffix(text, " BC")
		text = strings.TrimSuffix(text, " BC")
		// Year first, as many digits as it has, then Go's own layout.
		dash := strings.IndexByte(text, '-')
		year := 0
		for _, c := range text[:dash] {
			year = year*10 + int(c-'0')
		}
		if bc {
			year = 1 - year
		}
		rest, err := time.Parse("-01-02 15:04:05.000000-07", text[dash:])
		if err != nil {
			t.Fatalf("%s: %v", lit, err)
		}
		got := time.Date(year, rest.Month(), rest.Day(), rest.Hour(), rest.Minute(), rest.Second(), rest.Nanosecond(), time.UTC)
		if !got.Equal(at.Truncate(0).Add(-time.Duration(at.Nanosecond() % 1000))) {
			t.Fatalf("%s rendered as %s, which reads as %s", at, lit, got)
		}
	})
}
