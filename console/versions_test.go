package console_test

import (
	"context"
	"database/sql"
	"net/http"
	"testing"

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
