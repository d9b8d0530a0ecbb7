package storage

import (
	"database/sql/driver"
	"encoding/hex"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"
)

// conflictTag starts the text a statement with Expect casts to an integer
// when its row count is wrong: the cast's error (22P02) carries the
// statement's position and count back from the server, on both drivers,
// and stops the batch or transaction there.
const conflictTag = "millwright-conflict:"

var conflictRE = regexp.MustCompile(`millwright-conflict:(\d+):(\d+)`)

// withExpect returns s's SQL, wrapped so that the server fails it when it
// does not affect s.Expect rows (index is its position in its batch).
func withExpect(s Statement, index int) string {
	if s.Expect < 0 {
		return s.SQL
	}
	return "WITH millwright_expect AS (" + s.SQL + " RETURNING 1) SELECT CASE WHEN count(*) = " +
		strconv.FormatInt(s.Expect, 10) + " THEN 0 ELSE ('" + conflictTag + strconv.Itoa(index) +
		":' || count(*))::int END FROM millwright_expect"
}

// conflictOf turns the server's error for an unmet Expect into a
// *ConflictError, and returns any other error unchanged.
func conflictOf(err error, ss []Statement) error {
	if err == nil || Code(err) != "22P02" {
		return err
	}
	m := conflictRE.FindStringSubmatch(ServerMessage(err))
	if m == nil {
		return err
	}
	i, _ := strconv.Atoi(m[1])
	n, _ := strconv.ParseInt(m[2], 10, 64)
	if i < 0 || i >= len(ss) {
		return err
	}
	return &ConflictError{Index: i, What: ss[i].What, Affected: n, Expected: ss[i].Expect}
}

// inline returns s's SQL (with its Expect) with each $n replaced by its
// argument as a quoted literal: one simple query, one round trip on lib/pq,
// where a statement with parameters takes two.
func inline(s Statement, index int) (string, error) {
	q := withExpect(s, index)
	if len(s.Args) == 0 {
		return q, nil
	}
	var b strings.Builder
	b.Grow(len(q) + 16*len(s.Args))
	for i := 0; i < len(q); {
		j, err := skipQuoted(q, i)
		if err != nil {
			return "", err
		}
		if j > i { // a literal, identifier or comment: copied as it is
			b.WriteString(q[i:j])
			i = j
			continue
		}
		if n, end := placeholder(q, i); end > i {
			if n < 1 || n > len(s.Args) {
				return "", fmt.Errorf("storage: $%d in a statement with %d argument(s)", n, len(s.Args))
			}
			lit, err := literal(s.Args[n-1])
			if err != nil {
				return "", &ValueError{What: s.What, Arg: n, Err: err}
			}
			b.WriteString(lit)
			i = end
			continue
		}
		b.WriteByte(q[i])
		i++
	}
	return b.String(), nil
}

// placeholder returns the number of the $n at q[i] and the index after
// it, or end == i when there is none.
func placeholder(q string, i int) (n, end int) {
	if q[i] != '$' || i+1 >= len(q) || q[i+1] < '0' || q[i+1] > '9' || (i > 0 && isIdent(q[i-1])) {
		return 0, i
	}
	j := i + 1
	for j < len(q) && q[j] >= '0' && q[j] <= '9' {
		j++
	}
	n, _ = strconv.Atoi(q[i+1 : j])
	return n, j
}

// skipQuoted returns the index after the string literal, quoted
// identifier, comment or dollar-quoted string starting at q[i], or i when
// none starts there.
func skipQuoted(q string, i int) (int, error) {
	c := q[i]
	next := byte(0)
	if i+1 < len(q) {
		next = q[i+1]
	}
	switch {
	case c == '\'':
		escapes := i > 0 && (q[i-1] == 'E' || q[i-1] == 'e') && (i < 2 || !isIdent(q[i-2]))
		return skipString(q, i, escapes), nil
	case c == '"':
		return closing(q, i, 1, `"`, "identifier")
	case c == '-' && next == '-':
		if j := strings.IndexByte(q[i:], '\n'); j >= 0 {
			return i + j, nil
		}
		return len(q), nil
	case c == '/' && next == '*':
		return closing(q, i, 2, "*/", "comment")
	case c == '$' && (i == 0 || !isIdent(q[i-1])):
		return skipDollar(q, i)
	}
	return i, nil
}

// closing returns the index after the first end at or after q[i+from].
func closing(q string, i, from int, end, what string) (int, error) {
	j := strings.Index(q[i+from:], end)
	if j < 0 {
		return 0, fmt.Errorf("storage: unterminated %s in %q", what, q)
	}
	return i + from + j + len(end), nil
}

// skipDollar skips a dollar-quoted string ($tag$ ... $tag$) at q[i]; a $
// that starts none (a placeholder) is left alone.
func skipDollar(q string, i int) (int, error) {
	j := i + 1
	for j < len(q) && isIdent(q[j]) && !(j == i+1 && q[j] >= '0' && q[j] <= '9') {
		j++
	}
	if j >= len(q) || q[j] != '$' {
		return i, nil
	}
	return closing(q, j, 1, q[i:j+1], "dollar quote")
}

func isIdent(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c >= 0x80
}

// skipString returns the index after the string literal starting at i.
func skipString(q string, i int, escapes bool) int {
	for j := i + 1; j < len(q); j++ {
		switch q[j] {
		case '\\':
			if escapes {
				j++
			}
		case '\'':
			if j+1 < len(q) && q[j+1] == '\'' {
				j++
				continue
			}
			return j + 1
		}
	}
	return len(q)
}

// literal renders v as a Postgres literal.
func literal(v any) (string, error) {
	switch u := v.(type) {
	case uint64:
		if err := checkUint(u); err != nil {
			return "", err
		}
	case uint:
		if err := checkUint(uint64(u)); err != nil {
			return "", err
		}
	}
	if lit, ok := intLiteral(v); ok {
		return lit, nil
	}
	switch v := v.(type) {
	case nil:
		return "NULL", nil
	case string:
		if err := checkText(v); err != nil {
			return "", err
		}
		return pq.QuoteLiteral(v), nil
	case []byte:
		if v == nil {
			return "NULL", nil
		}
		return pq.QuoteLiteral(`\x`+hex.EncodeToString(v)) + "::bytea", nil
	case bool:
		return strconv.FormatBool(v), nil
	case float32:
		// The float32's exact value, as pgx sends it: its shortest float32
		// form ("0.1") would read back as another float8 than pgx stores.
		return "'" + strconv.FormatFloat(float64(v), 'g', -1, 64) + "'::float8", nil
	case float64:
		return "'" + strconv.FormatFloat(v, 'g', -1, 64) + "'::float8", nil
	case time.Time:
		return timeLiteral(v)
	case time.Duration:
		return "'" + strconv.FormatInt(v.Microseconds(), 10) + " microseconds'::interval", nil
	case []int64:
		return arrayLiteral(len(v), "bigint[]", func(i int) (string, error) { return strconv.FormatInt(v[i], 10), nil })
	case []int:
		return arrayLiteral(len(v), "bigint[]", func(i int) (string, error) { return strconv.Itoa(v[i]), nil })
	case []string:
		return arrayLiteral(len(v), "text[]", func(i int) (string, error) { return literal(v[i]) })
	case driver.Valuer:
		return valuerLiteral(v)
	}
	return "", fmt.Errorf("a %T cannot be sent as a Postgres literal", v)
}

// Postgres' timestamptz range. pgx computes a time's microseconds since
// 2000 through an int64 of microseconds since 1970, which overflows from
// 294247 on and wraps back for a time Postgres stores; past Postgres'
// range it wraps to another instant (year 584000 reached the server as
// 556 BC, and was stored), so both drivers refuse a time outside it.
var (
	minTime = time.Date(-4713, 11, 24, 0, 0, 0, 0, time.UTC) // 4714-11-24 BC, Julian day 0
	maxTime = time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC)  // exclusive
)

// unstorable is the reason a value cannot be stored, with the SQLSTATE
// the server gives the same refusal (so that code classifying errors by
// Code, as retry decisions do, treats it as the server's); it matches
// ErrUnstorable.
type unstorable struct {
	code, reason string
}

func (u unstorable) Error() string      { return u.reason }
func (unstorable) Is(target error) bool { return target == ErrUnstorable }

// CheckTime returns nil when Postgres stores t as it is (to the
// microsecond, on both drivers), else an error matching ErrUnstorable
// that says why: t is outside 4714-11-24 BC .. 294276-12-31 AD (UTC).
func CheckTime(t time.Time) error {
	if t.Before(minTime) || !t.Before(maxTime) {
		return unstorable{"22008", fmt.Sprintf("time %s is outside the range Postgres stores (4714-11-24 BC to 294276-12-31 AD, UTC)", t.Format(time.RFC3339Nano))}
	}
	return nil
}

// CheckText returns nil when Postgres stores s as text: valid UTF-8
// without a NUL byte (the server refuses either, SQLSTATE 22021), else an
// error matching ErrUnstorable that says where the bad byte is.
func CheckText(s string) error { return checkText(s) }

func checkText(s string) error {
	if i := strings.IndexByte(s, 0); i >= 0 {
		return unstorable{"22021", fmt.Sprintf("text contains a NUL byte (at byte %d), which Postgres cannot store", i)}
	}
	if !utf8.ValidString(s) {
		i := 0
		for i < len(s) {
			r, n := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && n == 1 {
				break
			}
			i += n
		}
		return unstorable{"22021", fmt.Sprintf("text is not valid UTF-8 (byte 0x%02x at %d), which Postgres cannot store as text: send bytes as []byte", s[i], i)}
	}
	return nil
}

// timeLiteral renders t as the instant it is, in UTC: Postgres reads
// neither Go's year 0 and negative years (it counts 1 BC, 2 BC, ...) nor
// offsets beyond ±15:59, both of which time.Time (and RFC 3339) hold. The
// fraction is cut to microseconds as pgx cuts it, where Postgres would
// round the nanoseconds of a literal: both drivers store one value.
func timeLiteral(t time.Time) (string, error) {
	if err := CheckTime(t); err != nil {
		return "", err
	}
	u := t.UTC()
	y, era := u.Year(), ""
	if y <= 0 {
		y, era = 1-y, " BC"
	}
	return fmt.Sprintf("'%04d-%02d-%02d %02d:%02d:%02d.%06d+00%s'::timestamptz",
		y, u.Month(), u.Day(), u.Hour(), u.Minute(), u.Second(), u.Nanosecond()/1000, era), nil
}

// checkArgs refuses, before anything is sent, an argument of s that
// Postgres cannot store as it is, as literal does on database/sql: pgx
// would send invalid UTF-8 and NUL bytes for the server to refuse, and a
// time past Postgres' range wrapped around to another instant.
func checkArgs(s Statement) error {
	for i, a := range s.Args {
		if err := checkArg(a); err != nil {
			return &ValueError{What: s.What, Arg: i + 1, Err: err}
		}
	}
	return nil
}

// checkUint refuses an unsigned integer past bigint's range: Postgres
// has no unsigned type, and the drivers refuse it each in its own way.
func checkUint(v uint64) error {
	if v > math.MaxInt64 {
		return unstorable{"22003", fmt.Sprintf("integer %d is past the range of bigint, Postgres' largest integer", v)}
	}
	return nil
}

func checkArg(a any) error {
	switch v := a.(type) {
	case uint64:
		return checkUint(v)
	case uint:
		return checkUint(uint64(v))
	case string:
		return checkText(v)
	case time.Time:
		return CheckTime(v)
	case []string:
		for _, e := range v {
			if err := checkText(e); err != nil {
				return err
			}
		}
	case driver.Valuer:
		dv, err := v.Value()
		if err != nil {
			return err
		}
		if _, again := dv.(driver.Valuer); !again {
			return checkArg(dv)
		}
	}
	return nil
}

// intLiteral renders the integer types.
func intLiteral(v any) (string, bool) {
	switch v := v.(type) {
	case int:
		return strconv.FormatInt(int64(v), 10), true
	case int8:
		return strconv.FormatInt(int64(v), 10), true
	case int16:
		return strconv.FormatInt(int64(v), 10), true
	case int32:
		return strconv.FormatInt(int64(v), 10), true
	case int64:
		return strconv.FormatInt(v, 10), true
	case uint8:
		return strconv.FormatUint(uint64(v), 10), true
	case uint16:
		return strconv.FormatUint(uint64(v), 10), true
	case uint32:
		return strconv.FormatUint(uint64(v), 10), true
	case uint:
		return strconv.FormatUint(uint64(v), 10), true
	case uint64:
		return strconv.FormatUint(v, 10), true
	}
	return "", false
}

// valuerLiteral renders what v's Value gives (sql.NullString, ...).
func valuerLiteral(v driver.Valuer) (string, error) {
	dv, err := v.Value()
	if err != nil {
		return "", err
	}
	if _, again := dv.(driver.Valuer); again {
		return "", fmt.Errorf("%T's Value is a driver.Valuer again", v)
	}
	return literal(dv)
}

func arrayLiteral(n int, typ string, elem func(i int) (string, error)) (string, error) {
	if n == 0 {
		return "'{}'::" + typ, nil
	}
	var b strings.Builder
	b.WriteString("ARRAY[")
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		e, err := elem(i)
		if err != nil {
			return "", err
		}
		b.WriteString(e)
	}
	b.WriteString("]::")
	b.WriteString(typ)
	return b.String(), nil
}

// inlineAll renders ss as one simple query. Its error is a *BatchError
// naming the statement that could not be rendered.
func inlineAll(ss []Statement) (string, error) {
	if len(ss) == 1 {
		q, err := inline(ss[0], 0)
		if err != nil {
			return "", &BatchError{Index: 0, Count: 1, What: ss[0].What, Err: err}
		}
		return q, nil
	}
	var b strings.Builder
	for i, s := range ss {
		q, err := inline(s, i)
		if err != nil {
			return "", &BatchError{Index: i, Count: len(ss), What: s.What, Err: err}
		}
		if i > 0 {
			b.WriteString(";\n")
		}
		b.WriteString(q)
	}
	return b.String(), nil
}

// whats joins the statements' What for an error of a batch whose failing
// statement the driver cannot name.
func whats(ss []Statement) string {
	var w []string
	for _, s := range ss {
		if s.What != "" && (len(w) == 0 || w[len(w)-1] != s.What) {
			w = append(w, s.What)
		}
	}
	return strings.Join(w, "; ")
}
