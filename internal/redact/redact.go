// Package redact hides passwords, tokens and other secrets in free text
// (error messages, log fields, command arguments) before it is logged,
// stored or shown.
//
//	log.Print(redact.Text(err.Error()))
//	// "dial postgres://app:xxxxx@db:5432/orders: refused" instead of the password
//
// What it hides: the password of every URL in the text (user:PASSWORD@),
// URL query parameters and key=value pairs whose key names a secret
// (password, sslpassword, sasl_password, pass, secret, token, credential(s),
// apikey, private, auth(orization), jwt), and a URL
// too malformed to parse (it may hold a password in a place net/url cannot
// find). What it cannot hide: a secret that is not marked as one (a bare
// token in a sentence).
//
// Logger wraps a watermill.LoggerAdapter so that messages, errors and
// string fields go through Text.
package redact

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
)

// Mask replaces a secret.
const Mask = "xxxxx"

// secretKey matches names of flags, query parameters and DSN keys whose
// values are secrets.
var secretKey = regexp.MustCompile(`(?i)(pass|secret|token|credential|apikey|api_key|private|auth|jwt)`)

// keyValueSecret matches key=value secrets: libpq key/value DSNs
// ("host=h password=p"), query strings, log lines.
var keyValueSecret = regexp.MustCompile(`(?i)\b([a-z_.-]*(?:pass|secret|token|credential|apikey|api_key|private|auth|jwt)[a-z_.-]*)\s*=\s*('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s&;,]*)`)

// urlInText finds URLs inside free text.
var urlInText = regexp.MustCompile(`[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>]+`)

// SecretName reports whether a flag, parameter or field name says its value
// is a secret.
func SecretName(name string) bool { return secretKey.MatchString(name) }

// Text returns s with its secrets replaced by Mask.
func Text(s string) string {
	if strings.Contains(s, "://") {
		s = urlInText.ReplaceAllStringFunc(s, URL)
	}
	if strings.Contains(s, "=") {
		s = keyValueSecret.ReplaceAllString(s, "${1}="+Mask)
	}
	return s
}

// URL returns raw with its password and secret query parameters replaced
// by Mask. A URL net/url refuses (a bad port, say) keeps its shape, with
// everything between the first ':' of the userinfo and the last '@' before
// the query masked.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return unparsedURL(raw)
	}
	if _, has := u.User.Password(); has {
		u.User = url.UserPassword(u.User.Username(), Mask)
	}
	if u.RawQuery != "" {
		q := u.Query()
		changed := false
		for k := range q {
			if SecretName(k) {
				q.Set(k, Mask)
				changed = true
			}
		}
		if changed {
			u.RawQuery = q.Encode()
		}
	}
	return u.String()
}

func unparsedURL(raw string) string {
	i := strings.Index(raw, "://")
	if i < 0 {
		return "<unparseable URL, not shown>"
	}
	scheme, rest := raw[:i+3], raw[i+3:]
	beforeQuery := rest
	if q := strings.IndexAny(rest, "?#"); q >= 0 {
		beforeQuery = rest[:q]
	}
	if at := strings.LastIndex(beforeQuery, "@"); at >= 0 {
		user := rest[:at]
		if c := strings.Index(user, ":"); c >= 0 {
			user = user[:c+1] + Mask
		}
		rest = user + rest[at:]
	}
	return scheme + keyValueSecret.ReplaceAllString(rest, "${1}="+Mask)
}

// Error returns err unchanged when its text holds no secret, else an error
// with the redacted text that still unwraps to err (for errors.Is/As).
func Error(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if r := Text(msg); r != msg {
		return &redactedError{msg: r, err: err}
	}
	return err
}

// ErrorOf is Error for the failure of an operation given rawURL (a dial,
// a connect): it also masks, wherever they appear in err's text, the
// password and the secret query values of rawURL, since a driver may quote
// them outside any URL. rawURL may be malformed.
func ErrorOf(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	r := msg
	for _, secret := range urlSecrets(rawURL) {
		r = strings.ReplaceAll(r, secret, Mask)
	}
	if r = Text(r); r == msg {
		return err
	}
	return &redactedError{msg: r, err: err}
}

// urlSecrets returns the password and secret query values of raw, parsed
// by net/url or, when it refuses raw, by hand.
func urlSecrets(raw string) []string {
	var out []string
	add := func(s string) {
		if s != "" && s != Mask {
			out = append(out, s)
		}
	}
	if u, err := url.Parse(raw); err == nil {
		if p, ok := u.User.Password(); ok {
			add(p)
		}
		for k, vs := range u.Query() {
			if SecretName(k) {
				for _, v := range vs {
					add(v)
				}
			}
		}
		return out
	}
	_, rest, ok := strings.Cut(raw, "://")
	if !ok {
		rest = raw
	}
	beforeQuery, query, _ := strings.Cut(rest, "?")
	if at := strings.LastIndex(beforeQuery, "@"); at >= 0 {
		if _, pw, ok := strings.Cut(beforeQuery[:at], ":"); ok {
			add(pw)
		}
	}
	for _, m := range keyValueSecret.FindAllStringSubmatch(query, -1) {
		add(strings.Trim(m[2], `'"`))
	}
	return out
}

type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

// Logger returns l with messages, errors and field values redacted. It
// returns l itself when l is already redacting.
func Logger(l watermill.LoggerAdapter) watermill.LoggerAdapter {
	if l == nil {
		return nil
	}
	if _, ok := l.(logger); ok {
		return l
	}
	return logger{l}
}

type logger struct{ l watermill.LoggerAdapter }

func fields(f watermill.LogFields) watermill.LogFields {
	var out watermill.LogFields
	for k, v := range f {
		var r any
		switch x := v.(type) {
		case string:
			if SecretName(k) {
				r = Mask
			} else if t := Text(x); t != x {
				r = t
			}
		case error:
			if t := Text(x.Error()); t != x.Error() {
				r = t
			}
		case fmt.Stringer:
			if s := x.String(); Text(s) != s {
				r = Text(s)
			}
		}
		if r == nil {
			continue
		}
		if out == nil {
			out = f.Copy()
		}
		out[k] = r
	}
	if out == nil {
		return f
	}
	return out
}

func (g logger) Error(msg string, err error, f watermill.LogFields) {
	if err != nil {
		if t := Text(err.Error()); t != err.Error() {
			err = errors.New(t)
		}
	}
	g.l.Error(Text(msg), err, fields(f))
}
func (g logger) Info(msg string, f watermill.LogFields)  { g.l.Info(Text(msg), fields(f)) }
func (g logger) Debug(msg string, f watermill.LogFields) { g.l.Debug(Text(msg), fields(f)) }
func (g logger) Trace(msg string, f watermill.LogFields) { g.l.Trace(Text(msg), fields(f)) }
func (g logger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return logger{g.l.With(fields(f))}
}

// JSON returns the JSON document b with its secrets masked: the value of
// every object key named like a secret (SecretName) replaced by Mask,
// whatever its type, and every other string through Text (URL passwords).
// Numbers keep their text. b that is not JSON is returned through Text.
func JSON(b []byte) []byte {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil || dec.More() {
		return []byte(Text(string(b)))
	}
	out, err := json.Marshal(jsonValue(v))
	if err != nil {
		return []byte(Text(string(b)))
	}
	return out
}

func jsonValue(v any) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if SecretName(k) {
				x[k] = Mask
			} else {
				x[k] = jsonValue(e)
			}
		}
	case []any:
		for i, e := range x {
			x[i] = jsonValue(e)
		}
	case string:
		return Text(x)
	}
	return v
}
