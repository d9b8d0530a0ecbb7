package dlq

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
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
