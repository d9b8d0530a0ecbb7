package console

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"net/url"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millwright/millwright/dlq"
)

// view is what every template gets: the layout's fields and the page's
// Data. Templates escape every value (html/template); none is marked safe.
type view struct {
	Title   string
	Nav     string
	Base    string
	Schema  string
	Schemas []string
	Actor   string
	CSRF    string
	Error   string
	Status  int
	Notice  string
	Data    any
	// Role is the operator's (Can, CanEdit).
	Role      Role
	neverEdit func(topic string) error
	now       time.Time
}

// URL returns the console's path with the schema and the key/value pairs
// as its query.
func (v *view) URL(path string, kv ...any) string {
	q := url.Values{}
	if v.Schema != "" {
		q.Set("schema", v.Schema)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		if s := fmt.Sprint(kv[i+1]); s != "" && s != "false" {
			q.Set(fmt.Sprint(kv[i]), s)
		}
	}
	u := v.Base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	return u
}

// Age is how long ago t was, rounded for reading.
func (v *view) Age(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return roundAge(v.now.Sub(t))
}

func roundAge(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return d.Round(time.Minute).String()
	default:
		return fmt.Sprintf("%dd", int(d.Hours()/24))
	}
}

var funcs = template.FuncMap{
	"when": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"whenp": func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"short":  shorten,
	"redact": dlq.Redacted,
	"dur":    roundAge,
}

// shorten returns s on one line of at most n runes.
func shorten(n int, s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}

// render writes page name with v.
func (h *Handler) render(q *req, name string, v *view) error {
	v.Base, v.Schema, v.Schemas, v.Actor = h.cfg.BasePath, q.schema, q.schemas, q.actor
	v.CSRF = h.csrfToken(q.w, q.Request)
	v.now = h.cfg.now()
	v.Role, v.neverEdit = q.role, h.editable
	var buf bytes.Buffer
	if err := h.tmpl.ExecuteTemplate(&buf, name, v); err != nil {
		return fmt.Errorf("rendering %s: %w", name, err)
	}
	q.w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if v.Status != 0 {
		q.w.WriteHeader(v.Status)
	}
	_, _ = buf.WriteTo(q.w)
	return nil
}

// payloadView is a payload as the console shows it.
type payloadView struct {
	// Kind is "json", "text" or "binary".
	Kind string
	// Text is the pretty-printed JSON, the text, or the hex dump.
	Text  string
	Bytes int
}

func viewPayload(p []byte) payloadView {
	v := payloadView{Bytes: len(p)}
	var buf bytes.Buffer
	switch {
	case len(p) > 0 && json.Valid(p) && json.Indent(&buf, p, "", "  ") == nil:
		v.Kind, v.Text = "json", buf.String()
	case utf8.Valid(p) && !bytes.ContainsRune(p, 0):
		v.Kind, v.Text = "text", string(p)
	default:
		v.Kind, v.Text = "binary", hex.Dump(p)
	}
	return v
}

// kv is one metadata entry.
type kv struct{ Key, Value string }

// metadataView splits metadata into CloudEvents attributes, trace context
// and the other headers, by key; values of keys named like a secret are
// masked, and every value has URL passwords masked.
func metadataView(md map[string]string) (ce, trace, other []kv) {
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		e := kv{k, shownValue(k, md[k])}
		switch {
		case strings.HasPrefix(k, "ce_"):
			ce = append(ce, e)
		case k == "traceparent" || k == "tracestate":
			trace = append(trace, e)
		default:
			other = append(other, e)
		}
	}
	return ce, trace, other
}

// diffLine is one line of a diff: Op is " ", "-" or "+".
type diffLine = dlq.DiffLine

// lineDiff is the line diff of a and b (dlq.LineDiff, the one the audit
// row of the edit keeps too).
func lineDiff(a, b string) []diffLine { return dlq.LineDiff(a, b) }
