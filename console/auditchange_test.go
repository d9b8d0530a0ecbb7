package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

func TestAnEditsAuditRowShowsTheDiffWithSecretsMasked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.deadLetter(t, "orders", "T", "bad quantity", []byte(`{"order":"o-1","qty":"x"}`),
		map[string]string{"api_token": "tok-s3cr3t-value", "tenant": "acme"})
	tok := b.token(t)
	sid := strconv.FormatInt(id, 10)

	// The metadata as the form shows it (the secret masked), with tenant
	// changed; the masked value left as shown keeps the stored secret.
	status, body := b.get(t, "/dead-letters/"+sid+"/edit")
	require.Equal(t, http.StatusOK, status, body)
	require.NotContains(t, body, "tok-s3cr3t-value")
	md := `{"api_token": "xxxxx", "tenant": "globex", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`
	status, body = b.post(t, "/dead-letters/"+sid+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"order":"o-1","qty":2}`},
		"metadata": {md}, "action": {"replay"}})
	require.Equal(t, http.StatusOK, status, body)

	change := pgtest.Column[string](t, b.schema.DB, `SELECT change FROM millwright_audit WHERE command = $1`, dlq.EditReplayCommand)
	require.Len(t, change, 1)
	require.Contains(t, change[0], "payload:\n")
	require.Contains(t, change[0], "-   \"qty\": \"x\"\n")
	require.Contains(t, change[0], "+   \"qty\": 2\n")
	require.Contains(t, change[0], "metadata:\n")
	require.Contains(t, change[0], "-   \"tenant\": \"acme\",\n")
	require.Contains(t, change[0], "+   \"tenant\": \"globex\",\n")
	require.NotContains(t, change[0], "tok-s3cr3t-value", "the secret stays masked in the audit row")
	require.Contains(t, change[0], `"api_token": "xxxxx"`)
	// The secret was kept, not replaced by the mask.
	sent := pgtest.Column[string](t, b.schema.DB, `SELECT metadata->>'api_token' FROM millwright_outbox WHERE topic = 'orders'`)
	require.Equal(t, []string{"tok-s3cr3t-value"}, sent)

	status, body = b.get(t, "/audit")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `<span class="dhead">payload:</span>`)
	require.Contains(t, body, `<span class="ddel">-   &#34;qty&#34;: &#34;x&#34;</span>`)
	require.Contains(t, body, `<span class="dadd">&#43;   &#34;qty&#34;: 2</span>`)
	require.Contains(t, body, `<span class="dadd">&#43;   &#34;tenant&#34;: &#34;globex&#34;,</span>`)
	require.NotContains(t, body, "tok-s3cr3t-value")
}
