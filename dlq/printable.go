package dlq

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/millwright/millwright/internal/redact"
)

// Printable is a dead letter's UUID, metadata key or value as an operator
// reads it: as it is when it is printable text, else Go-quoted ("\n\xff"),
// so that a binary Kafka key or header shows which bytes it holds instead
// of U+FFFD or control characters. `millwright dlq list/show` and the
// console show them this way.
func Printable(s string) string {
	if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

// Redacted is s with its secrets masked: the password of every URL, and
// query parameters and key=value pairs named like a secret. The operator
// console shows errors, stacks and metadata through it.
func Redacted(s string) string { return redact.Text(s) }

// RedactedValue is metadata value v of key k as an operator may see it:
// masked whole when k is named like a secret (a token, a password),
// Redacted otherwise.
func RedactedValue(k, v string) string {
	if redact.SecretName(k) {
		return redact.Mask
	}
	return redact.Text(v)
}
