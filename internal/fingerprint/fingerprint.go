// Package fingerprint names the cause of a failure: its error message
// with what varies from one occurrence to the next (numbers, UUIDs, hex
// ids, durations, quoted values) replaced by placeholders, hashed with the
// error's Go type and the failing handler. Dead letters of one cause share
// a fingerprint (package dlq stores it with each, the console and
// `millwright dlq groups` group by it); two causes that share a Go type
// (every errors.New is an *errors.errorString) do not.
//
// It is in internal/ so that the storage layer's fallback writer computes
// the same fingerprint as dlq.RecordTx; dlq exports it (dlq.Fingerprint,
// dlq.NormalizeError).
package fingerprint

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strings"
	"unicode/utf8"
)

// MaxPattern bounds the normalised message, in bytes: a fingerprint is of
// the message's start, where its cause is said; what follows (a wrapped
// error's long tail, a dump) does not split a group.
const MaxPattern = 1024

// The placeholders. None holds a digit, a quote or a hex word, so a
// normalised message normalises to itself.
const (
	phUUID     = "<uuid>"
	phHex      = "<hex>"
	phDuration = "<duration>"
	phNumber   = "<n>"
	phValue    = "<value>"
)

var (
	// Quoted values: "..." (backslash escapes inside), `...`, and '...'
	// opened after a character that is not a letter or digit (so that
	// the apostrophes of "can't ... don't" are not a quote), nor '>' (a
	// digit's placeholder ends with it: 0'0' is no quote, nor <n>'<n>').
	quoted = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|`[^`]*`|(?:^|[^\\p{L}\\p{N}'>])'[^']*'")
	uuid   = regexp.MustCompile(`(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`)
	hexNum = regexp.MustCompile(`(?i)\b0x[0-9a-f]+\b`)
	// A word of hex digits, at least 8, with a digit and a letter: an
	// object id, a hash, a trace id (a word of decimal digits is a number).
	hexWord  = regexp.MustCompile(`(?i)\b[0-9a-f]{8,}\b`)
	duration = regexp.MustCompile(`\b(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+\b`)
	number   = regexp.MustCompile(`\d+(?:\.\d+)*`)
)

// Normalize returns msg with its varying parts replaced by placeholders,
// spaces collapsed, cut to MaxPattern bytes. It never fails, and
// Normalize(Normalize(s)) == Normalize(s).
func Normalize(msg string) string {
	s := strings.ToValidUTF8(msg, "\uFFFD")
	// One pass is meant to reach the fixed point; the loop is the
	// guarantee for an input whose replacements make a new match.
	for range 4 {
		n := normalize(s)
		if n == s {
			break
		}
		s = n
	}
	return s
}

func normalize(s string) string {
	s = quoted.ReplaceAllStringFunc(s, func(m string) string {
		switch m[len(m)-1] {
		case '"':
			if m[0] == '"' {
				return `"` + phValue + `"`
			}
		case '`':
			return "`" + phValue + "`"
		}
		// '...' with the character before it, kept.
		i := strings.IndexByte(m, '\'')
		return m[:i] + "'" + phValue + "'"
	})
	s = uuid.ReplaceAllString(s, phUUID)
	s = hexNum.ReplaceAllString(s, phHex)
	s = hexWord.ReplaceAllStringFunc(s, func(w string) string {
		if strings.ContainsAny(w, "0123456789") && strings.ContainsAny(strings.ToLower(w), "abcdef") {
			return phHex
		}
		return w
	})
	s = duration.ReplaceAllString(s, phDuration)
	s = number.ReplaceAllString(s, phNumber)
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > MaxPattern {
		cut := MaxPattern
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = strings.TrimRight(s[:cut], " ")
	}
	return s
}

// Of returns the fingerprint of a failure: 16 hex digits of the SHA-256 of
// the handler, the error's Go type and its normalised message.
func Of(handler, errorType, msg string) string {
	h := sha256.New()
	h.Write([]byte(handler))
	h.Write([]byte{0})
	h.Write([]byte(errorType))
	h.Write([]byte{0})
	h.Write([]byte(Normalize(msg)))
	return hex.EncodeToString(h.Sum(nil)[:8])
}
