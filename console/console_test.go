package console_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// bundle is what a console test needs: a migrated schema, the console
// on it behind a test server, and a client that keeps the CSRF cookie.
type bundle struct {
	schema *pgtest.Schema
	srv    *httptest.Server
	client *http.Client
	store  *dlq.Store
	base   string
}

const testActor = "alice"

// setup migrates a schema and serves the console on it; extra, if given,
// adjusts the configuration.
func setup(t *testing.T, extra ...func(*console.Config)) *bundle {
	t.Helper()
	return setupOn(t, pgtest.DriverPQ, extra...)
}

// setupOn is setup with the console on driver's pool: a *sql.DB
// (pgtest.DriverPQ) or a *pgxpool.Pool (pgtest.DriverPgx).
func setupOn(t *testing.T, driver string, extra ...func(*console.Config)) *bundle {
	t.Helper()
	s := pgtest.New(t, migrations.All()...)
	cfg := console.Config{
		Authenticate: func(w http.ResponseWriter, r *http.Request) (string, bool) {
			if u, _, ok := r.BasicAuth(); ok {
				return u, true
			}
			return testActor, true
		},
		Schemas: []string{s.Name},
	}
	for _, f := range extra {
		f(&cfg)
	}
	var (
		h   *console.Handler
		err error
	)
	if driver == pgtest.DriverPgx {
		h, err = console.New(postgres.From(s.Pgx(t)), cfg)
	} else {
		h, err = console.New(postgres.From(s.DB), cfg)
	}
	require.NoError(t, err)
	mux := http.NewServeMux()
	prefix := cfg.BasePath
	mux.Handle(prefix+"/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, Timeout: 20 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return &bundle{schema: s, srv: srv, client: client, store: dlq.NewStore(postgres.From(s.DB)), base: srv.URL + prefix}
}

// deadLetter stores a dead letter of topic with payload and returns its id.
func (b *bundle) deadLetter(t *testing.T, topic, errType, errText string, payload []byte, md map[string]string) int64 {
	t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), payload)
	msg.Metadata.Set(metadata.EventID, "evt-"+msg.UUID)
	msg.Metadata.Set(metadata.TraceParent, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	msg.Metadata.Set(metadata.DeadLetterOriginalTopic, topic)
	msg.Metadata.Set(metadata.DeadLetterTopic, dlq.DefaultTopic(topic))
	msg.Metadata.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
	msg.Metadata.Set(metadata.DeadLetterError, errText)
	msg.Metadata.Set(metadata.DeadLetterErrorType, errType)
	msg.Metadata.Set(metadata.DeadLetterAttempts, "3")
	msg.Metadata.Set(metadata.DeadLetterStack, "goroutine 1 [running]:\nmain.handler()")
	now := time.Now().UTC()
	msg.Metadata.Set(metadata.DeadLetterFirstFailure, now.Add(-time.Minute).Format(time.RFC3339Nano))
	msg.Metadata.Set(metadata.DeadLetterLastFailure, now.Format(time.RFC3339Nano))
	for k, v := range md {
		msg.Metadata.Set(k, v)
	}
	id, err := b.store.Insert(context.Background(), msg)
	require.NoError(t, err)
	require.NotZero(t, id)
	return id
}

// get fetches path and returns the status and body.
func (b *bundle) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := b.client.Get(b.base + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

var csrfRe = regexp.MustCompile(`<meta name="millwright-csrf" content="([^"]+)">`)

// token returns the CSRF token of a page (and sets the cookie).
func (b *bundle) token(t *testing.T) string {
	t.Helper()
	status, body := b.get(t, "/dead-letters")
	require.Equal(t, http.StatusOK, status, body)
	m := csrfRe.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token on the dead-letters page")
	}
	return m[1]
}

// post submits a form (with the token, when not empty) and returns the
// status and body.
func (b *bundle) post(t *testing.T, path, token string, form url.Values) (int, string) {
	t.Helper()
	if token != "" {
		form.Set("csrf", token)
	}
	req, err := http.NewRequest(http.MethodPost, b.base+path, strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// outboxPayloads returns the payloads queued in the outbox for topic.
func (b *bundle) outboxPayloads(t *testing.T, topic string) []string {
	t.Helper()
	return pgtest.Column[string](t, b.schema.DB, `SELECT convert_from(payload_raw, 'UTF8') FROM millwright_outbox WHERE topic = $1 ORDER BY id`, topic)
}

func (b *bundle) state(t *testing.T, id int64) string {
	t.Helper()
	return pgtest.Column[string](t, b.schema.DB, `SELECT state FROM millwright_dead_letters WHERE id = $1`, id)[0]
}

func TestEditAndReplayQueuesTheEditedCopyAndSupersedesTheOriginal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.deadLetter(t, "orders.created", "*json.SyntaxError", "bad quantity", []byte(`{"qty":"x"}`), nil)
	tok := b.token(t)
	sid := strconv.FormatInt(id, 10)

	status, body := b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"qty":2}`}, "action": {"preview"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `<span class="ddel">-   &#34;qty&#34;: &#34;x&#34;</span>`, "the dry run shows the removed line")
	require.Contains(t, body, `<span class="dadd">&#43;   &#34;qty&#34;: 2</span>`, "and the added one")
	require.Empty(t, b.outboxPayloads(t, "orders.created"), "a preview queues nothing")

	status, body = b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"qty":2}`}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "superseded")
	require.Equal(t, []string{`{"qty":2}`}, b.outboxPayloads(t, "orders.created"))
	require.Equal(t, "superseded", b.state(t, id))

	// The queued copy keeps the original event id and says what it replays.
	var md string
	require.NoError(t, b.schema.DB.QueryRow(`SELECT metadata::text FROM millwright_outbox WHERE topic = 'orders.created'`).Scan(&md))
	var m map[string]string
	require.NoError(t, json.Unmarshal([]byte(md), &m))
	require.Equal(t, sid, m[metadata.DeadLetterReplayOf])

	// Neither a second edit nor a plain replay sends anything now.
	status, body = b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"qty":3}`}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "another operator")
	status, body = b.post(t, "/dead-letters/replay", tok, url.Values{"id": {sid}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "already replayed, superseded or resolved")
	require.Equal(t, []string{`{"qty":2}`}, b.outboxPayloads(t, "orders.created"))

	// The audit table names the operator and the action.
	who := pgtest.Column[string](t, b.schema.DB, `SELECT os_user || ' ' || command FROM millwright_audit ORDER BY id`)
	require.Equal(t, []string{testActor + " " + dlq.EditReplayCommand}, who, "the audit row dlq.ReplayTx writes, whoever calls it")
}
