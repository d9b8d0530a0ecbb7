package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/saga"
)

func TestSagaVersionsCommand(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, current_step, data, def_version) VALUES
		('o-1', 'orders', 'completed', 2, '{}', 1),
		('o-2', 'orders', 'running', 1, '{}', 2),
		('o-3', 'orders', 'stuck', 0, '{}', 2)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO millwright_saga_definitions (type, version, fingerprint, graph) VALUES ('orders', 3, 'fff', 'step a')`)
	require.NoError(t, err)

	out, err := runSaga(t, s.URL, "versions")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 4, out)
	require.Regexp(t, `^TYPE\s+VERSION\s+LIVE\s+RUNNING\s+COMPENSATING\s+STUCK\s+COMPLETED\s+COMPENSATED\s+STATUS\s+LAST SEEN$`, lines[0])
	require.Regexp(t, `^orders\s+1\s+0\s+0\s+0\s+0\s+1\s+0\s+retired\s+-$`, lines[1])
	require.Regexp(t, `^orders\s+2\s+2\s+1\s+0\s+1\s+0\s+0\s+in use\s+-$`, lines[2])
	require.Regexp(t, `^orders\s+3\s+0\s+0\s+0\s+0\s+0\s+0\s+retired\s+\d{4}-`, lines[3], "registered, no instance")

	out, err = runSaga(t, s.URL, "versions", "--json")
	require.NoError(t, err)
	var rows []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m))
		rows = append(rows, m)
	}
	require.Len(t, rows, 3)
	require.Equal(t, map[string]any{"running": 1.0, "stuck": 1.0}, rows[1]["counts"])
	require.Equal(t, false, rows[1]["retired"])
	require.Equal(t, []any{"fff"}, rows[2]["fingerprints"])

	out, err = runSaga(t, s.URL, "list", "--type", "orders")
	require.NoError(t, err)
	require.Regexp(t, `(?m)^o-2\s+orders\s+v2\s+running`, out)
	out, err = runSaga(t, s.URL, "show", "o-2")
	require.NoError(t, err)
	require.Regexp(t, `(?m)^definition version:\s+2$`, out)
}
