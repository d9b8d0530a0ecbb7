package console_test

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/outbox/capture"
	"github.com/millwright/millwright/postgres"
)

func TestStateChangesNeedAPostWithTheCSRFTokenFromTheConsolesOwnOrigin(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.deadLetter(t, "csrf", "T", "boom", []byte(`{}`), nil)
	sid := strconv.FormatInt(id, 10)
	tok := b.token(t)
	form := func() url.Values { return url.Values{"id": {sid}, "action": {"replay"}} }

	status, body := b.post(t, "/dead-letters/replay", "", form())
	require.Equal(t, http.StatusForbidden, status, "no token")
	require.Contains(t, body, "CSRF token")
	status, _ = b.post(t, "/dead-letters/replay", tok+"x", form())
	require.Equal(t, http.StatusForbidden, status, "a wrong token")

	// Another operator's token (signed for alice) does not work for bob,
	// even with alice's cookie.
	req, _ := http.NewRequest(http.MethodPost, b.base+"/dead-letters/replay", strings.NewReader(url.Values{"id": {sid}, "action": {"replay"}, "csrf": {tok}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.SetBasicAuth("bob", "x")
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "a token signed for another operator")

	for _, h := range []struct{ name, value string }{{"Origin", "https://evil.example"}, {"Sec-Fetch-Site", "cross-site"}, {"Sec-Fetch-Site", "same-site"}} {
		f := form()
		f.Set("csrf", tok)
		req, _ := http.NewRequest(http.MethodPost, b.base+"/dead-letters/replay", strings.NewReader(f.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set(h.name, h.value)
		resp, err := b.client.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusForbidden, resp.StatusCode, "%s: %s", h.name, h.value)
	}

	// GET never changes anything.
	status, _ = b.get(t, "/dead-letters/replay?id="+sid+"&action=replay")
	require.Equal(t, http.StatusBadRequest, status, "GET /dead-letters/replay is the id path of a dead letter named replay")
	resp, err = b.client.Get(b.base + "/outbox/retry-failed")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	require.Equal(t, "dead", b.state(t, id), "nothing was replayed")
	require.Empty(t, b.outboxPayloads(t, "csrf"))

	// The console's own form, same origin, goes through.
	f := form()
	f.Set("csrf", tok)
	req, _ = http.NewRequest(http.MethodPost, b.base+"/dead-letters/replay", strings.NewReader(f.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", b.srv.URL)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	resp, err = b.client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "replayed", b.state(t, id))
	require.Equal(t, []string{"{}"}, b.outboxPayloads(t, "csrf"))
}

func TestTheCSRFCookieIsHttpOnlyStrictAndUnderTheBasePath(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *console.Config) { c.BasePath = "/ops" })
	resp, err := b.client.Get(b.base + "/dead-letters")
	require.NoError(t, err)
	resp.Body.Close()
	var c *http.Cookie
	for _, x := range resp.Cookies() {
		if x.Name == "millwright_console_csrf" {
			c = x
		}
	}
	require.NotNil(t, c)
	require.True(t, c.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, c.SameSite)
	require.Equal(t, "/ops", c.Path)

	resp, err = b.client.Get(b.srv.URL + "/elsewhere")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "outside the base path")
	resp, err = b.client.Get(b.srv.URL + "/ops/")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, "/ops/dead-letters?", resp.Header.Get("Location"))
}

func TestAuthenticationHookDecides(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, migrations.All()...)
	_, err := console.New(postgres.From(s.DB), console.Config{})
	require.ErrorContains(t, err, "Authenticate is nil")
	_, err = console.New(postgres.From((*sql.DB)(nil)), console.Config{Authenticate: console.ContextActor})
	require.ErrorContains(t, err, "db is nil")
	_, err = console.New(postgres.From(s.DB), console.Config{Authenticate: console.ContextActor, CSRFKey: []byte("short")})
	require.ErrorContains(t, err, "CSRFKey")
	_, err = console.New(postgres.From(s.DB), console.Config{Authenticate: console.ContextActor, BasePath: "ops"})
	require.ErrorContains(t, err, "BasePath")

	h, err := console.New(postgres.From(s.DB), console.Config{Authenticate: console.ContextActor, Schemas: []string{s.Name}})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/dead-letters", nil))
	require.Equal(t, http.StatusUnauthorized, rec.Code, "no operator in the context")
	require.NotEmpty(t, rec.Header().Get("Content-Security-Policy"), "security headers on refusals too")

	rec = httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/dead-letters", nil)
	h.ServeHTTP(rec, req.WithContext(console.WithActor(req.Context(), "carol")))
	require.Equal(t, http.StatusOK, rec.Code)
	require.Contains(t, rec.Body.String(), `<span class="actor">carol</span>`)

	empty, err := console.New(postgres.From(s.DB), console.Config{Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return " ", true }})
	require.NoError(t, err)
	rec = httptest.NewRecorder()
	empty.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/dead-letters", nil))
	require.Equal(t, http.StatusInternalServerError, rec.Code, "an empty operator name is refused")
}

func TestEveryValueIsEscaped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.deadLetter(t, `<b>topic</b>`, `"><script>alert(1)</script>`, `<img src=x onerror=alert(2)>`,
		[]byte(`<script>alert(3)</script>`), map[string]string{"x-note": `</td><script>alert(4)</script>`})
	sid := strconv.FormatInt(id, 10)
	for _, path := range []string{"/dead-letters", "/dead-letters?all=1&topic=%3Cb%3Etopic%3C%2Fb%3E", "/dead-letters/" + sid, "/dead-letters/" + sid + "/edit"} {
		status, body := b.get(t, path)
		require.Equal(t, http.StatusOK, status, path)
		require.NotContains(t, body, "<script>alert", path)
		require.NotContains(t, body, "<img src=x", path)
		require.NotContains(t, body, "<b>topic", path)
		require.Contains(t, body, "&lt;", path)
	}
	_, body := b.get(t, "/dead-letters/"+sid)
	require.Contains(t, body, "&lt;script&gt;alert(3)&lt;/script&gt;", "the payload renders as text")
	require.Contains(t, body, "&lt;/td&gt;&lt;script&gt;alert(4)", "so do the headers")
	// The only scripts are the console's own file.
	require.Equal(t, 1, strings.Count(body, "<script"), body)
}

func TestSecretsAreNeverShown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const secret = "hunter2"
	id := b.deadLetter(t, "secrets", "T", "dial postgres://app:"+secret+"@db.internal:5432/orders?sslmode=disable: refused",
		[]byte(`{}`), map[string]string{"password": secret, "callback": "amqp://u:" + secret + "@mq/"})
	sid := strconv.FormatInt(id, 10)
	for _, path := range []string{"/dead-letters", "/dead-letters/" + sid, "/dead-letters/" + sid + "/edit", "/audit",
		"/dead-letters/postgres:%2F%2Fu:" + secret + "@h"} {
		_, body := b.get(t, path)
		require.NotContains(t, body, secret, path)
	}
	status, body := b.post(t, "/dead-letters/"+sid+"/edit", b.token(t), url.Values{"encoding": {"text"}, "payload": {`{"a":1}`},
		"metadata": {`{"password": "` + redact.Mask + `", "callback": "amqp://u:` + redact.Mask + `@mq/", "extra": "1"}`}, "action": {"preview"}})
	require.Equal(t, http.StatusOK, status, body)
	require.NotContains(t, body, secret)

	// An edit that leaves the masked values as shown keeps the stored ones.
	status, body = b.post(t, "/dead-letters/"+sid+"/edit", b.token(t), url.Values{"encoding": {"text"}, "payload": {`{"a":1}`},
		"metadata": {`{"password": "` + redact.Mask + `", "callback": "amqp://u:` + redact.Mask + `@mq/", "extra": "1"}`}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	md := pgtest.Column[string](t, b.schema.DB, `SELECT metadata->>'password' || ' ' || (metadata->>'callback') || ' ' || (metadata->>'extra') FROM millwright_outbox WHERE topic = 'secrets'`)
	require.Equal(t, []string{secret + " amqp://u:" + secret + "@mq/ 1"}, md)
}

func TestTheSchemaIsOneOfThoseWithMillwrightTables(t *testing.T) {
	t.Parallel()
	one := pgtest.New(t, migrations.All()...)
	two := pgtest.New(t, migrations.All()...)
	empty := pgtest.New(t)
	for _, s := range []*pgtest.Schema{one, two} {
		_, err := s.DB.Exec(`INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, first_failure_at, last_failure_at, payload)
			VALUES ($1, $1, 'x.dlq', now(), now(), '')`, "in-"+s.Name)
		require.NoError(t, err)
	}
	h, err := console.New(postgres.From(one.DB), console.Config{
		Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return "op", true },
		Schemas:      []string{empty.Name, two.Name, one.Name, "no_such_schema"},
	})
	require.NoError(t, err)
	get := func(query string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/dead-letters?"+query, nil))
		return rec.Code, rec.Body.String()
	}
	status, body := get("")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, "in-"+two.Name, "the first configured schema holding tables")
	require.NotContains(t, body, "<option>"+empty.Name, "a schema without millwright tables is not offered")
	status, body = get("schema=" + one.Name)
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, "in-"+one.Name)
	require.NotContains(t, body, "in-"+two.Name)
	for _, bad := range []string{empty.Name, "no_such_schema", "public", `x"; DROP SCHEMA public; --`} {
		status, body = get("schema=" + url.QueryEscape(bad))
		require.Equal(t, http.StatusBadRequest, status, bad)
		require.Contains(t, body, "unknown schema", bad)
	}

	none, err := console.New(postgres.From(empty.DB), console.Config{
		Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return "op", true }, Schemas: []string{empty.Name}})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	none.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/sagas", nil))
	require.Equal(t, http.StatusServiceUnavailable, rec.Code)
	require.Contains(t, rec.Body.String(), "millwright migrate")
}

func TestErrorsNameTheProblem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, c := range []struct {
		path   string
		status int
		says   string
	}{
		{"/dead-letters/999", http.StatusNotFound, "no dead letter 999"},
		{"/dead-letters/abc", http.StatusBadRequest, "want a positive number"},
		{"/sagas/nope", http.StatusNotFound, `no saga &#34;nope&#34;`},
		{"/sagas?state=bogus", http.StatusBadRequest, "want one of running"},
	} {
		status, body := b.get(t, c.path)
		require.Equal(t, c.status, status, c.path)
		require.Contains(t, body, c.says, c.path)
	}
	tok := b.token(t)
	status, body := b.post(t, "/dead-letters/replay", tok, url.Values{"action": {"replay"}})
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, "no dead letter selected")
	status, body = b.post(t, "/dead-letters/1/edit", tok, url.Values{"encoding": {"hex"}, "payload": {"zz"}, "action": {"preview"}})
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, "not hex")
}

func TestReplayASelectionAfterItsDryRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.deadLetter(t, "sel", "T", "boom", []byte(`{"n":1}`), nil)
	c := b.deadLetter(t, "sel", "T", "boom", []byte{0, 1, 0xff}, nil)
	tok := b.token(t)
	ids := url.Values{"id": {strconv.FormatInt(a, 10), strconv.FormatInt(c, 10)}}

	ids.Set("action", "preview")
	status, body := b.post(t, "/dead-letters/replay", tok, ids)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "Dry run: nothing has been sent")
	require.Contains(t, body, "00000000  00 01 ff", "a binary payload shows as hex")
	require.Contains(t, body, "Replay 2 message(s)")
	require.Empty(t, b.outboxPayloads(t, "sel"))

	ids.Set("action", "replay")
	status, body = b.post(t, "/dead-letters/replay", tok, ids)
	require.Equal(t, http.StatusOK, status, body)
	require.Len(t, pgtest.Column[int64](t, b.schema.DB, `SELECT id FROM millwright_outbox WHERE topic = 'sel'`), 2)
	require.Equal(t, "replayed", b.state(t, a))
	require.Equal(t, "replayed", b.state(t, c))

	// The dry run of replayed rows says they will not be sent.
	ids.Set("action", "preview")
	_, body = b.post(t, "/dead-letters/replay", tok, ids)
	require.Contains(t, body, "is replayed: it will not be sent")
	require.NotContains(t, body, `id="confirm"`)
	// Shown among all, not among the pending ones.
	_, body = b.get(t, "/dead-letters")
	require.NotContains(t, body, `data-id="`+strconv.FormatInt(a, 10)+`"`)
	_, body = b.get(t, "/dead-letters?all=1")
	require.Contains(t, body, `data-id="`+strconv.FormatInt(a, 10)+`"`)
}

func TestOutboxPageAndRetryFailed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.schema.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		VALUES ('e1', 'payments', 'a', '{}', 'failed', 9, 'broker said <no>'), ('e2', 'payments', 'b', '{}', 'pending', 2, 'slow')`)
	require.NoError(t, err)
	status, body := b.get(t, "/outbox")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "broker said &lt;no&gt;")
	require.Contains(t, body, "<td>payments</td><td>1</td><td>1</td><td>1</td>", "pending, retrying and failed of the topic")
	require.Contains(t, body, "no relay has announced itself", "lanes never leased (-infinity) read fine")

	ids := pgtest.Column[string](t, b.schema.DB, `SELECT id::text FROM millwright_outbox WHERE event_id = 'e1'`)
	status, body = b.post(t, "/outbox/retry-failed", b.token(t), url.Values{"id": ids})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "1 failed row(s) put back to pending")
	require.Equal(t, []string{"pending 0"}, pgtest.Column[string](t, b.schema.DB, `SELECT status || ' ' || retry_count FROM millwright_outbox WHERE event_id = 'e1'`))
	require.Equal(t, []string{testActor + " console outbox retry-failed 1"},
		pgtest.Column[string](t, b.schema.DB, `SELECT os_user || ' ' || command || ' ' || affected FROM millwright_audit`))
}

// Issue 40 item 4: while Debezium capture is on, retry-failed is refused
// with the reason and the fix (the insert-only publication would never
// stream the row), and nothing changes.
func TestOutboxRetryFailedRefusedUnderCapture(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.schema.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		VALUES ('e1', 'payments', 'a', '{}', 'failed', 9, 'down')`)
	require.NoError(t, err)
	pub := "con_" + b.schema.Name
	require.NoError(t, capture.Enable(context.Background(), postgres.From(b.schema.DB), pub))
	t.Cleanup(func() { _ = capture.Disable(context.Background(), postgres.From(b.schema.DB), pub) })
	ids := pgtest.Column[string](t, b.schema.DB, `SELECT id::text FROM millwright_outbox WHERE event_id = 'e1'`)
	status, body := b.post(t, "/outbox/retry-failed", b.token(t), url.Values{"id": ids})
	require.Equal(t, http.StatusConflict, status, body)
	require.Contains(t, body, "Debezium capture is on")
	require.Contains(t, body, "switch-to-relay")
	require.Equal(t, []string{"failed 9"}, pgtest.Column[string](t, b.schema.DB, `SELECT status || ' ' || retry_count FROM millwright_outbox WHERE event_id = 'e1'`))
	require.Empty(t, pgtest.Column[string](t, b.schema.DB, `SELECT command FROM millwright_audit`))
}

func TestResolveAStuckSagaWithAReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	q := storage.NewSQLPool(b.schema.DB)
	_, err := storage.InsertSaga(context.Background(), q, storage.SagaInstance{ID: "s-1", Type: "transfer", State: "stuck", Step: 0, Data: []byte(`{}`)},
		[]storage.SagaStep{{Step: "debit", Kind: "command", Attempt: 1}, {Step: "debit", Kind: "stuck", Attempt: 3, Error: "refund service down"}})
	require.NoError(t, err)
	status, body := b.get(t, "/sagas?state=stuck")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "s-1")
	status, body = b.get(t, "/sagas/s-1")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "Mark it done by hand")
	tok := b.token(t)

	status, body = b.post(t, "/sagas/s-1/resolve", tok, url.Values{"action": {"skip"}})
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, "needs a reason")
	status, body = b.post(t, "/sagas/s-1/resolve", tok, url.Values{"action": {"skip"}, "reason": {"refunded by hand, ticket 42"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "becomes compensated")
	// Handed back to the orchestrators, whose next round finishes it.
	require.Equal(t, []string{"compensating"}, pgtest.Column[string](t, b.schema.DB, `SELECT state FROM millwright_saga_instances WHERE id = 's-1'`))
	require.Equal(t, []string{"skip: alice: refunded by hand, ticket 42"},
		pgtest.Column[string](t, b.schema.DB, `SELECT detail FROM millwright_saga_steps WHERE saga_id = 's-1' AND kind = 'resolved'`))
	require.Equal(t, []string{"alice console saga resolve"}, pgtest.Column[string](t, b.schema.DB, `SELECT os_user || ' ' || command FROM millwright_audit`))

	status, body = b.post(t, "/sagas/s-1/resolve", b.token(t), url.Values{"action": {"retry"}, "reason": {"again"}})
	require.Equal(t, http.StatusConflict, status)
	require.Contains(t, body, "not stuck")
}

func TestSecurityHeadersOnEveryAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, path := range []string{"/dead-letters", "/static/style.css", "/static/console.js", "/dead-letters/999", "/sagas", "/outbox", "/audit"} {
		resp, err := b.client.Get(b.base + path)
		require.NoError(t, err)
		resp.Body.Close()
		h := resp.Header
		require.Contains(t, h.Get("Content-Security-Policy"), "script-src 'self'", path)
		require.NotContains(t, h.Get("Content-Security-Policy"), "unsafe-inline", path)
		require.Contains(t, h.Get("Content-Security-Policy"), "frame-ancestors 'none'", path)
		require.Equal(t, "DENY", h.Get("X-Frame-Options"), path)
		require.Equal(t, "nosniff", h.Get("X-Content-Type-Options"), path)
	}
}
