package console_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// The dead letters page's filter, replayed in bulk from the console: a
// dry run with the count and a sample, a cap, a job whose page shows its
// progress, one audit row with the filter.
func TestBulkReplayFromTheConsoleOverThePagesFilter(t *testing.T) {
	t.Parallel()
	b, role, _ := roleSetup(t)
	role.Store(console.RoleOperator)
	for range 25 {
		b.deadLetter(t, "orders", "T", "ledger down", []byte(`{}`), nil)
	}
	b.deadLetter(t, "orders", "T", "bad quantity", []byte(`{}`), nil)
	b.deadLetter(t, "invoices", "T", "ledger down", []byte(`{}`), nil)
	tok := b.token(t)
	filter := url.Values{"topic": {"orders"}, "q": {"ledger"}}

	_, body := b.get(t, "/dead-letters?topic=orders&q=ledger")
	require.Contains(t, body, `id="bulk-replay"`)
	require.NotContains(t, body, `id="bulk-discard"`, "discarding needs an admin")
	status, body := b.post(t, "/dead-letters/bulk/discard", tok, filter)
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "needs the admin role")

	status, body = b.post(t, "/dead-letters/bulk/replay", tok, url.Values{"topic": {"orders"}, "q": {"ledger"}})
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `selects <b>25</b> dead letter(s)`)
	require.Equal(t, 10, strings.Count(body, `href="/dead-letters/`), "a sample of 10")
	require.Empty(t, b.outboxPayloads(t, "orders"), "the dry run queues nothing")

	f := url.Values{"topic": {"orders"}, "q": {"ledger"}, "step": {"confirm"}, "cap": {"24"}}
	status, body = b.post(t, "/dead-letters/bulk/replay", tok, f)
	require.Equal(t, http.StatusConflict, status, "a cap under the count: %s", body)
	require.Contains(t, body, "over the cap of 24")

	f.Set("cap", "25")
	status, body = b.post(t, "/dead-letters/bulk/replay", tok, f)
	require.Equal(t, http.StatusSeeOther, status, body)
	poll.Until(t, 60*time.Second, func() bool {
		_, page := b.get(t, "/bulk/1")
		return strings.Contains(page, `<td id="bulk-state">done</td>`)
	}, "the bulk job finishes")
	_, body = b.get(t, "/bulk/1")
	require.Contains(t, body, `<span id="bulk-done">25</span> of 25 done`)
	require.Len(t, b.outboxPayloads(t, "orders"), 25)
	rows := pgtest.Column[string](t, b.schema.DB, `SELECT os_user || ' | ' || command || ' | ' || array_to_string(args, ' ') || ' | ' || affected FROM millwright_audit`)
	require.Equal(t, []string{"alice | bulk replay dead letters | --topic=orders --error-contains=ledger --job=1 --planned=25 --cap=25 --skipped=0 | 25"}, rows)
	_, body = b.get(t, "/audit")
	require.Contains(t, body, "bulk replay dead letters")
}
