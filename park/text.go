package park

import (
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// storable returns s as text Postgres accepts: valid UTF-8 without NUL
// (a row refused would be redelivered forever).
func storable(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

func storableMetadata(md message.Metadata) map[string]string {
	out := make(map[string]string, len(md))
	for k, v := range md {
		out[storable(k)] = storable(v)
	}
	return out
}
