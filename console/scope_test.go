package console_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// The console shows other teams' schemas only when asked to.
func TestTheConsoleListsOnlyTheSchemasItIsConfiguredWith(t *testing.T) {
	t.Parallel()
	mine := pgtest.New(t, migrations.All()...)
	theirs := pgtest.New(t, migrations.All()...)
	auth := func(http.ResponseWriter, *http.Request) (string, bool) { return "op", true }
	serve := func(cfg console.Config, query string) (int, string) {
		t.Helper()
		cfg.Authenticate = auth
		h, err := console.New(postgres.From(mine.DB), cfg) // mine.DB's search_path is mine
		require.NoError(t, err)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/dead-letters?"+query, nil))
		return rec.Code, rec.Body.String()
	}
	option := func(s string) string { return "<option selected>" + s + "</option>" }

	// Default: the pool's current schema only.
	status, body := serve(console.Config{}, "")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, option(mine.Name))
	require.NotContains(t, body, theirs.Name, "another schema of the database is not listed")
	status, body = serve(console.Config{}, "schema="+theirs.Name)
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, "unknown schema")

	// Config.Schemas: those.
	status, body = serve(console.Config{Schemas: []string{theirs.Name}}, "")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, option(theirs.Name))
	require.NotContains(t, body, "<option>"+mine.Name)
	status, _ = serve(console.Config{Schemas: []string{theirs.Name}}, "schema="+mine.Name)
	require.Equal(t, http.StatusBadRequest, status, "the pool's own schema is not offered when not configured")

	// AllSchemas: every schema holding millwright tables, on request.
	status, body = serve(console.Config{AllSchemas: true}, "")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, option(mine.Name), "the current schema first")
	require.Contains(t, body, "<option>"+theirs.Name+"</option>")
	status, _ = serve(console.Config{AllSchemas: true}, "schema="+theirs.Name)
	require.Equal(t, http.StatusOK, status)
}
