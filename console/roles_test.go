package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// roleSetup serves the console with an Identify hook giving alice the
// role the test sets, and payments.* never editable.
func roleSetup(t *testing.T) (*bundle, *atomic.Value, []console.Route) {
	t.Helper()
	var role atomic.Value
	role.Store(console.RoleViewer)
	var cfg console.Config
	b := setup(t, func(c *console.Config) {
		c.Authenticate = nil
		c.Identify = func(http.ResponseWriter, *http.Request) (console.Identity, bool) {
			return console.Identity{Name: testActor, Role: role.Load().(console.Role)}, true
		}
		c.NeverEdit = []string{"payments.*"}
		cfg = *c
	})
	h, err := console.New(postgres.From(b.schema.DB), cfg)
	require.NoError(t, err)
	return b, &role, h.Routes()
}

// concrete fills a route pattern's wildcards.
func concrete(pattern, id string) (method, path string) {
	method, path, _ = strings.Cut(pattern, " ")
	for strings.Contains(path, "{") {
		i, j := strings.Index(path, "{"), strings.Index(path, "}")
		path = path[:i] + id + path[j+1:]
	}
	return method, path
}

func TestAViewerIsRefusedEveryActionEvenWithAValidCSRFToken(t *testing.T) {
	t.Parallel()
	b, _, routes := roleSetup(t)
	id := b.deadLetter(t, "orders", "T", "boom", []byte(`{"n":1}`), nil)
	sid := strconv.FormatInt(id, 10)
	tok := b.token(t) // a viewer reads pages, and gets a valid token

	var posts int
	for _, r := range routes {
		method, path := concrete(r.Pattern, sid)
		if method == http.MethodGet {
			continue
		}
		require.Equal(t, http.MethodPost, method, "the console changes state only through POST: %s", r.Pattern)
		require.NotEqual(t, console.RoleViewer, r.Role, "%s is an action: a viewer may not run it", r.Pattern)
		posts++
		form := url.Values{"id": {sid}, "action": {"replay"}, "encoding": {"text"}, "payload": {`{"n":2}`}, "reason": {"r"}, "topic": {"orders"}, "all": {"1"}, "confirm": {"1"}}
		status, body := b.post(t, path, tok, form)
		require.Equal(t, http.StatusForbidden, status, "%s: %s", r.Pattern, body)
		require.Contains(t, body, "needs the "+string(r.Role)+" role", r.Pattern)
		require.Contains(t, body, "alice is a viewer", r.Pattern)
	}
	require.GreaterOrEqual(t, posts, 4, "the router's POST routes were walked")
	require.Equal(t, "dead", b.state(t, id), "nothing was replayed")
	require.Empty(t, b.outboxPayloads(t, "orders"))
	require.Empty(t, pgtest.Column[string](t, b.schema.DB, `SELECT command FROM millwright_audit`))

	// The pages hide what a viewer cannot do.
	status, body := b.get(t, "/dead-letters/"+sid)
	require.Equal(t, http.StatusOK, status, body)
	require.NotContains(t, body, `id="replay"`)
	require.NotContains(t, body, `id="edit"`)
	require.Contains(t, body, `<span class="role" id="role">(viewer)</span>`)
	_, body = b.get(t, "/dead-letters")
	require.NotContains(t, body, `id="replay-selected"`)
	require.NotContains(t, body, `class="pick"`)
}

func TestAnOperatorReplaysButCannotEdit(t *testing.T) {
	t.Parallel()
	b, role, _ := roleSetup(t)
	role.Store(console.RoleOperator)
	id := b.deadLetter(t, "orders", "T", "boom", []byte(`{"n":1}`), nil)
	sid := strconv.FormatInt(id, 10)
	tok := b.token(t)

	status, body := b.get(t, "/dead-letters/"+sid)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `id="replay"`)
	require.NotContains(t, body, `id="edit"`, "an operator is not shown the edit")
	status, body = b.get(t, "/dead-letters/"+sid+"/edit")
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "needs the admin role")
	status, body = b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"n":2}`}, "action": {"replay"}})
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "needs the admin role; alice is an operator")
	require.Equal(t, "dead", b.state(t, id))
	require.Empty(t, b.outboxPayloads(t, "orders"))

	status, body = b.post(t, "/dead-letters/replay", tok, url.Values{"id": {sid}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Equal(t, "replayed", b.state(t, id))
	require.Equal(t, []string{`{"n":1}`}, b.outboxPayloads(t, "orders"), "unchanged")
}

func TestANonEditableTopicRefusesEditsForEveryRole(t *testing.T) {
	t.Parallel()
	b, role, _ := roleSetup(t)
	role.Store(console.RoleAdmin)
	pay := b.deadLetter(t, "payments.card", "T", "declined", []byte(`{"amount":100}`), nil)
	ord := b.deadLetter(t, "orders", "T", "boom", []byte(`{"n":1}`), nil)
	tok := b.token(t)
	for _, r := range console.Roles {
		role.Store(r)
		sid := strconv.FormatInt(pay, 10)
		status, body := b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"amount":1}`}, "action": {"replay"}})
		require.Equal(t, http.StatusForbidden, status, "%s: %s", r, body)
		if r == console.RoleAdmin {
			require.Contains(t, body, `topic &#34;payments.card&#34; is never editable`)
			status, body = b.get(t, "/dead-letters/"+sid+"/edit")
			require.Equal(t, http.StatusForbidden, status, body)
			_, body = b.get(t, "/dead-letters/"+sid)
			require.NotContains(t, body, `id="edit"`, "the page hides the edit of a non-editable topic")
		}
	}
	require.Equal(t, "dead", b.state(t, pay))
	require.Empty(t, b.outboxPayloads(t, "payments.card"))

	// An admin edits another topic.
	role.Store(console.RoleAdmin)
	sid := strconv.FormatInt(ord, 10)
	_, body := b.get(t, "/dead-letters/"+sid)
	require.Contains(t, body, `id="edit"`)
	status, body := b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"n":2}`}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Equal(t, []string{`{"n":2}`}, b.outboxPayloads(t, "orders"))
}

func TestRolesConfiguration(t *testing.T) {
	t.Parallel()
	// A host that set Authenticate before roles keeps every action
	// (DefaultRole admin); DefaultRole viewer makes it read-only.
	b := setup(t, func(c *console.Config) { c.DefaultRole = console.RoleViewer })
	id := b.deadLetter(t, "orders", "T", "boom", []byte(`{}`), nil)
	tok := b.token(t)
	status, body := b.post(t, "/dead-letters/replay", tok, url.Values{"id": {strconv.FormatInt(id, 10)}, "action": {"replay"}})
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "needs the operator role")

	s := b.schema
	auth := func(http.ResponseWriter, *http.Request) (string, bool) { return "a", true }
	_, err := console.New(postgres.From(s.DB), console.Config{Authenticate: auth, Identify: console.ContextIdentity})
	require.ErrorContains(t, err, "both set")
	_, err = console.New(postgres.From(s.DB), console.Config{Authenticate: auth, DefaultRole: "root"})
	require.ErrorContains(t, err, `role "root": want one of viewer, operator, admin`)
	_, err = console.New(postgres.From(s.DB), console.Config{Authenticate: auth, NeverEdit: []string{"[payments"}})
	require.ErrorContains(t, err, "NeverEdit")
	require.True(t, console.RoleAdmin.Allows(console.RoleOperator))
	require.False(t, console.RoleOperator.Allows(console.RoleAdmin))
	require.False(t, console.Role("").Allows(console.RoleViewer))
}

// Skipping a parked key dead-letters its head and goes on without it: an
// admin's action, refused to an operator (who may retry and release).
func TestAnOperatorCannotSkipAParkedKey(t *testing.T) {
	t.Parallel()
	b, role, _ := roleSetup(t)
	role.Store(console.RoleOperator)
	tok := b.token(t)
	status, body := b.post(t, "/parked/action", tok, url.Values{"op": {"skip"}, "handler": {"h"}, "key": {"k"}})
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "skip of a parked key needs the admin role")
	// Release passes the role check (and fails on the key, which is not parked).
	status, body = b.post(t, "/parked/action", tok, url.Values{"op": {"release"}, "handler": {"h"}, "key": {"k"}})
	require.NotEqual(t, http.StatusForbidden, status, body)
}
