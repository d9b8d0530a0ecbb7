package fingerprint_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/fingerprint"
)

func TestNormalize(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"charging order 1234: card declined":                                 "charging order <n>: card declined",
		"charging order 98: card declined":                                   "charging order <n>: card declined",
		"account 3f2a6c1e-9b7d-4c2a-8e1f-0a1b2c3d4e5f not found":             "account <uuid> not found",
		"account 3F2A6C1E-9B7D-4C2A-8E1F-0A1B2C3D4E5F not found":             "account <uuid> not found",
		"object 507f1f77bcf86cd799439011 missing, trace 0xdeadbeef":          "object <hex> missing, trace <hex>",
		"context deadline exceeded after 1m30.5s (budget 500ms)":             "context deadline exceeded after <duration> (budget <duration>)",
		`user "alice" has no role 'admin'`:                                   `user "<value>" has no role '<value>'`,
		"can't decode: don't know field `amount_cents`":                      "can't decode: don't know field `<value>`",
		`decoding "{\"qty\":\"two\"}": want int`:                             `decoding "<value>": want int`,
		"pq: duplicate key value violates unique constraint \"orders_pkey\"": "pq: duplicate key value violates unique constraint \"<value>\"",
		"  spaces\tand\nnewlines  ":                                          "spaces and newlines",
		"deadbeef is a word, facade too":                                     "deadbeef is a word, facade too",
		"v1.2.3 at 2026-12-06T09:50:58Z":                                     "v<n> at <n>-<n>-<n>T<n>:<n>:<n>Z",
	} {
		require.Equal(t, want, fingerprint.Normalize(in), "Normalize(%q)", in)
	}
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	a := fingerprint.Of("billing", "*errors.errorString", "order 17 refused: amount 250 over limit")
	b := fingerprint.Of("billing", "*errors.errorString", "order 9 refused: amount 12000 over limit")
	c := fingerprint.Of("billing", "*errors.errorString", "ledger unavailable")
	require.Equal(t, a, b, "two occurrences of one cause, differing in numbers")
	require.NotEqual(t, a, c, "another cause of the same Go type")
	require.NotEqual(t, a, fingerprint.Of("shipping", "*errors.errorString", "order 17 refused: amount 250 over limit"), "another handler")
	require.NotEqual(t, a, fingerprint.Of("billing", "*fmt.wrapError", "order 17 refused: amount 250 over limit"), "another Go type")
	require.Len(t, a, 16)
}

func TestNormalizeBoundsLongMessages(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é failure ", 1000)
	n := fingerprint.Normalize(long)
	require.LessOrEqual(t, len(n), fingerprint.MaxPattern)
	require.True(t, utf8.ValidString(n))
	require.Equal(t, n, fingerprint.Normalize(n))
}

// FuzzNormalize: Normalize never panics, returns valid UTF-8 no longer
// than MaxPattern, and is idempotent.
func FuzzNormalize(f *testing.F) {
	for _, s := range []string{"", "order 12 failed", `x "a\"b" 'c' ` + "`d`", "0x1f 0xZZ", "1h2m3.5s", "it's 'a' b'", `"unterminated`,
		"3f2a6c1e-9b7d-4c2a-8e1f-0a1b2c3d4e5f", "\xff\x00bad", "'a''b'", `\"x"`, "a1b2c3d4e5f6 99"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n := fingerprint.Normalize(s)
		if len(n) > fingerprint.MaxPattern || !utf8.ValidString(n) {
			t.Fatalf("Normalize(%q) = %q: longer than MaxPattern or not UTF-8", s, n)
		}
		if again := fingerprint.Normalize(n); again != n {
			t.Fatalf("not idempotent: Normalize(%q) = %q, then %q", s, n, again)
		}
	})
}
