package storage

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ErrJSONBRefuses is returned (wrapped) by CheckJSONB, and so by
// InsertSaga and SagaTransition for saga data, for JSON that Postgres'
// jsonb would refuse: a string or key holding the \u0000 escape (a NUL
// character, SQLSTATE 22P05), an unpaired UTF-16 surrogate escape, or a
// number outside numeric's range (22003). The error names the field (a
// JSON path such as $.note). It is returned before any statement runs,
// on every driver: the same JSON would be refused on every retry.
var ErrJSONBRefuses = errors.New("JSON that Postgres jsonb cannot store")

// Postgres numeric's bounds (numeric.c): a nonzero value's leading digit
// at most 10^131071 (NUMERIC_WEIGHT_MAX base-10000 digits), at most 16383
// digits after the decimal point (NUMERIC_DSCALE_MAX), and an exponent
// below INT_MAX/2.
const (
	maxNumericPower = 131071
	maxNumericScale = 16383
	maxNumericExp   = 1<<30 - 1
)

// CheckJSONB returns an error wrapping ErrJSONBRefuses, naming the field,
// when data holds a value a jsonb column refuses. Text that is not JSON is
// left to its caller (json.Valid) or the server.
func CheckJSONB(data []byte) error {
	s := jsonScanner{b: data}
	s.value("$")
	if s.bad == "" || !json.Valid(data) {
		return nil
	}
	return fmt.Errorf("%w: %s %s, which Postgres jsonb refuses: %s", ErrJSONBRefuses, s.path, s.bad, s.fix)
}

// jsonScanner walks JSON text looking for what jsonb refuses, keeping the
// path of the value it is in. It stops at the first problem (bad) or at
// text that is not JSON (invalid: the server reports that).
type jsonScanner struct {
	b        []byte
	i        int
	path     string
	bad, fix string
	invalid  bool
	depth    int
}

func (s *jsonScanner) stop() bool { return s.bad != "" || s.invalid }

func (s *jsonScanner) ws() {
	for s.i < len(s.b) && (s.b[s.i] == ' ' || s.b[s.i] == '\t' || s.b[s.i] == '\n' || s.b[s.i] == '\r') {
		s.i++
	}
}

// maxJSONDepth bounds the scan's recursion, as encoding/json bounds
// nesting: deeper text is left to the server.
const maxJSONDepth = 10000

func (s *jsonScanner) value(path string) {
	if s.depth++; s.depth > maxJSONDepth {
		s.invalid = true
		return
	}
	defer func() { s.depth-- }()
	s.ws()
	if s.i >= len(s.b) {
		s.invalid = true
		return
	}
	switch c := s.b[s.i]; {
	case c == '{':
		s.i++
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == '}' {
			s.i++
			return
		}
		for !s.stop() {
			s.ws()
			key, ok := s.str(path, true)
			if !ok {
				return
			}
			s.ws()
			if s.i >= len(s.b) || s.b[s.i] != ':' {
				s.invalid = true
				return
			}
			s.i++
			s.value(childPath(path, key))
			s.ws()
			if s.stop() || s.i >= len(s.b) {
				s.invalid = s.invalid || s.i >= len(s.b)
				return
			}
			if s.b[s.i] == '}' {
				s.i++
				return
			}
			if s.b[s.i] != ',' {
				s.invalid = true
				return
			}
			s.i++
		}
	case c == '[':
		s.i++
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == ']' {
			s.i++
			return
		}
		for n := 0; !s.stop(); n++ {
			s.value(path + "[" + strconv.Itoa(n) + "]")
			s.ws()
			if s.stop() || s.i >= len(s.b) {
				s.invalid = s.invalid || s.i >= len(s.b)
				return
			}
			if s.b[s.i] == ']' {
				s.i++
				return
			}
			if s.b[s.i] != ',' {
				s.invalid = true
				return
			}
			s.i++
		}
	case c == '"':
		s.str(path, false)
	case c == '-' || (c >= '0' && c <= '9'):
		s.number(path)
	default:
		for _, lit := range []string{"true", "false", "null"} {
			if strings.HasPrefix(string(s.b[s.i:min(len(s.b), s.i+5)]), lit) {
				s.i += len(lit)
				return
			}
		}
		s.invalid = true
	}
}

// childPath is path's member key, as $.key or $["odd key"].
func childPath(path, key string) string {
	ident := key != ""
	for i, r := range key {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || i > 0 && r >= '0' && r <= '9') {
			ident = false
			break
		}
	}
	if ident {
		return path + "." + key
	}
	return path + "[" + strconv.QuoteToASCII(key) + "]"
}

// str reads a string at s.i; as a key, it returns its text for the path.
// A string jsonb refuses stops the scan with path (a key's own path).
func (s *jsonScanner) str(path string, isKey bool) (string, bool) {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		s.invalid = true
		return "", false
	}
	s.i++
	var text strings.Builder
	where := func() string {
		if isKey {
			return path + " has a key that"
		}
		return path
	}
	pendingHigh := false
	for s.i < len(s.b) {
		c := s.b[s.i]
		switch {
		case c == '"':
			if pendingHigh {
				return s.loneSurrogate(where(), "high")
			}
			s.i++
			if isKey {
				return text.String(), true
			}
			return "", true
		case c == '\\':
			if s.i+1 >= len(s.b) {
				s.invalid = true
				return "", false
			}
			if s.b[s.i+1] != 'u' {
				if pendingHigh {
					return s.loneSurrogate(where(), "high")
				}
				if isKey {
					text.WriteByte(unescape(s.b[s.i+1]))
				}
				s.i += 2
				continue
			}
			if s.i+6 > len(s.b) {
				s.invalid = true
				return "", false
			}
			v, err := strconv.ParseUint(string(s.b[s.i+2:s.i+6]), 16, 16)
			if err != nil {
				s.invalid = true
				return "", false
			}
			s.i += 6
			switch {
			case v == 0:
				s.path, s.bad = where(), `holds the escape \u0000 (a NUL character)`
				s.fix = "Postgres text cannot hold NUL: remove it, or keep binary values in a []byte field (base64 in JSON)"
				return "", false
			case v >= 0xD800 && v <= 0xDBFF:
				if pendingHigh {
					return s.loneSurrogate(where(), "high")
				}
				pendingHigh = true
			case v >= 0xDC00 && v <= 0xDFFF:
				if !pendingHigh {
					return s.loneSurrogate(where(), "low")
				}
				pendingHigh = false
				if isKey {
					text.WriteRune(utf8.RuneError) // the pair's rune is not needed for a path
				}
			default:
				if pendingHigh {
					return s.loneSurrogate(where(), "high")
				}
				if isKey {
					text.WriteRune(rune(v))
				}
			}
		default:
			if pendingHigh {
				return s.loneSurrogate(where(), "high")
			}
			if isKey {
				text.WriteByte(c)
			}
			s.i++
		}
	}
	s.invalid = true
	return "", false
}

// loneSurrogate stops the scan at a surrogate escape whose other half
// (half: the one present, high or low) is missing.
func (s *jsonScanner) loneSurrogate(path, half string) (string, bool) {
	s.path, s.bad = path, "holds an unpaired UTF-16 surrogate escape (a "+half+" surrogate alone)"
	s.fix = "send valid text (a lone surrogate is no character)"
	return "", false
}

func unescape(c byte) byte {
	switch c {
	case 'n':
		return '\n'
	case 't':
		return '\t'
	case 'r':
		return '\r'
	case 'b':
		return '\b'
	case 'f':
		return '\f'
	}
	return c // " \ /
}

// number reads a number at s.i and stops the scan if numeric cannot hold
// it.
func (s *jsonScanner) number(path string) {
	start := s.i
	if s.b[s.i] == '-' {
		s.i++
	}
	intStart := s.i
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	intDigits := s.b[intStart:s.i]
	var fracDigits []byte
	if s.i < len(s.b) && s.b[s.i] == '.' {
		s.i++
		fs := s.i
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
		}
		fracDigits = s.b[fs:s.i]
	}
	exp := int64(0)
	if s.i < len(s.b) && (s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.i++
		es := s.i
		if s.i < len(s.b) && (s.b[s.i] == '+' || s.b[s.i] == '-') {
			s.i++
		}
		ds := s.i
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
		}
		digits := strings.TrimLeft(string(s.b[ds:s.i]), "0")
		if len(digits) > 10 {
			digits = "99999999999" // beyond any bound below
		}
		v, err := strconv.ParseInt(string(s.b[es:ds])+"0"+digits, 10, 64)
		if err != nil {
			s.invalid = true
			return
		}
		exp = v
	}
	if len(intDigits) == 0 {
		s.invalid = true
		return
	}
	tooBig := func() {
		s.path, s.bad = path, "is the number "+abbreviate(string(s.b[start:s.i]))
		s.fix = "numeric holds at most 131072 digits before the decimal point and 16383 after it: store such a value as a string"
	}
	if exp >= maxNumericExp || exp <= -maxNumericExp {
		tooBig()
		return
	}
	if scale := int64(len(fracDigits)) - exp; scale > maxNumericScale {
		tooBig()
		return
	}
	// The power of ten of the leading nonzero digit.
	all := string(intDigits) + string(fracDigits)
	if lead := strings.IndexFunc(all, func(r rune) bool { return r != '0' }); lead >= 0 {
		if power := int64(len(intDigits)) - 1 - int64(lead) + exp; power > maxNumericPower {
			tooBig()
		}
	}
}

// abbreviate cuts a long number for an error message.
func abbreviate(s string) string {
	if len(s) <= 40 {
		return s
	}
	return s[:20] + "…" + s[len(s)-12:] + " (" + strconv.Itoa(len(s)) + " characters)"
}
