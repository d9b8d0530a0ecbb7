package console_test

import (
	"context"
	"database/sql"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func TestSagaPagesShowTheDefinitionVersion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	q := storage.NewSQLPool(b.schema.DB)
	for _, in := range []storage.SagaInstance{
		{ID: "s-1", Type: "transfer", State: "running", Data: []byte(`{}`), DefVersion: 2, DefFingerprint: sql.NullString{String: "f2", Valid: true}},
		{ID: "s-0", Type: "transfer", State: "completed", Data: []byte(`{}`), DefVersion: 1},
	} {
		_, err := storage.InsertSaga(context.Background(), q, in, []storage.SagaStep{{Step: "debit", Kind: "command", Attempt: 1}})
		require.NoError(t, err)
	}
	status, body := b.get(t, "/sagas")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "By definition version")
	require.Contains(t, body, "<tr><td>transfer</td><td>v1</td><td>0</td><td>1</td><td>retired</td></tr>")
	require.Contains(t, body, "<tr><td>transfer</td><td>v2</td><td>1</td><td>0</td><td>in use</td></tr>")
	require.Contains(t, body, "<td>transfer</td><td>v2</td><td class=\"state-running\">")
	status, body = b.get(t, "/sagas/s-1")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `<td id="def-version">v2</td>`)
}

// The saga page shows the saga's data with its secrets masked, the state
// of each parallel branch (the branches' entries marked on the timeline),
// and the event a waiting step waits for.
func TestSagaPageShowsDataBranchesAndWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	q := storage.NewSQLPool(b.schema.DB)
	ctx := context.Background()
	due := sql.NullTime{Time: time.Date(2031, 1, 2, 3, 4, 5, 0, time.UTC), Valid: true}
	_, err := storage.InsertSaga(ctx, q, storage.SagaInstance{ID: "g-1", Type: "orders", State: "running", Step: 1, Deadline: due,
		Data:     []byte(`{"order_id":"o-9","api_token":"tok_secret","callback":"https://u:pw123@h.example/x"}`),
		Branches: []byte(`{"reserve":{"state":"succeeded"},"charge":{"state":"running","deadline":"2031-01-02T03:04:05Z"}}`)},
		[]storage.SagaStep{{Step: "reserve", Kind: "command", Attempt: 1}, {Step: "charge", Kind: "command", Attempt: 1}, {Step: "reserve", Kind: "reply", Detail: "reserve.succeeded", Attempt: 1}})
	require.NoError(t, err)
	_, err = storage.InsertSaga(ctx, q, storage.SagaInstance{ID: "w-1", Type: "orders", State: "running", Deadline: due, Data: []byte(`{}`)},
		[]storage.SagaStep{{Step: "approve", Kind: "wait", Detail: "order.approved", Attempt: 1}})
	require.NoError(t, err)

	status, body := b.get(t, "/sagas/g-1")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `&#34;order_id&#34;: &#34;o-9&#34;`, "the data is shown")
	require.NotContains(t, body, "tok_secret", "a secret-named key is masked")
	require.NotContains(t, body, "pw123", "a URL's password is masked")
	require.Contains(t, body, `<tr><td>charge</td><td class="branch-running">running</td><td>2031-01-02 03:04:05Z</td><td>-</td></tr>`)
	require.Contains(t, body, `<tr><td>reserve</td><td class="branch-succeeded">succeeded</td><td>-</td><td>-</td></tr>`)
	require.Contains(t, body, `class="tl-forward tl-branch"`, "the branches' entries are marked on the timeline")

	status, body = b.get(t, "/sagas/w-1")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `<span class="meta" id="waiting">waiting for event order.approved until 2031-01-02 03:04:05Z</span>`)
	require.Contains(t, body, `class="tl-wait"`)
	require.NotContains(t, body, `id="branches"`)
}
