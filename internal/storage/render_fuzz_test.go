package storage

import (
	"strings"
	"testing"
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
	for _, s := range []string{"", "plain", "it's", `back\slash`, `\'`, "'; DROP TABLE t; --", "$1", "$$", "é\u2028", "E'x'"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		if strings.IndexByte(v, 0) >= 0 {
			if _, err := inline(Statement{SQL: `SELECT $1`, Args: []any{v}, Expect: NoExpect}, 0); err == nil {
				t.Fatal("a NUL byte was inlined")
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
