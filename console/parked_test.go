package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// Skip of a key still being retried, from the console: the dry run
// changes nothing; a confirmation naming another head than the key's
// (the key moved on since the dry run) is refused with nothing done; the
// confirmed skip dead-letters the head (park.SkipTx), the key goes on
// with its next message, and the audit row names the operator.
func TestParkedSkipDryRunThenConfirm(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.schema.DB
	_, err := db.Exec(`INSERT INTO millwright_parked_keys (handler, key, due_at, attempts, rounds, last_error)
		VALUES ('ledger', '\x6b'::bytea || convert_to('acct-1', 'UTF8'), now() + interval '1 hour', 4, 2, 'ledger timeout after 30s')`)
	require.NoError(t, err)
	for _, id := range []string{"m1", "m2"} {
		_, err := db.Exec(`INSERT INTO millwright_parked_messages (handler, key, message_uuid, topic, payload, metadata)
			VALUES ('ledger', '\x6b'::bytea || convert_to('acct-1', 'UTF8'), convert_to($1, 'UTF8'), 'ledger.entries', '{}'::bytea, ''::bytea)`, id)
		require.NoError(t, err)
	}
	head := pgtest.Column[int64](t, db, `SELECT min(id) FROM millwright_parked_messages`)[0]

	status, body := b.get(t, "/parked?state=retrying")
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "ledger timeout after 30s")
	require.Contains(t, body, `<td class="waiting">1</td>`)

	tok := b.token(t)
	form := func(kv ...string) url.Values {
		v := url.Values{"handler": {"ledger"}, "key": {"acct-1"}, "op": {"skip"}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}
	status, body = b.post(t, "/parked/action", tok, form())
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, "dead-letter the head")
	require.Equal(t, []int64{2}, pgtest.Column[int64](t, db, `SELECT count(*) FROM millwright_parked_messages`), "the dry run changed nothing")

	status, body = b.post(t, "/parked/action", tok, form("step", "confirm", "head", strconv.FormatInt(head+100, 10)))
	require.Equal(t, http.StatusConflict, status, body)
	require.Contains(t, body, "changed since the dry run")
	require.Equal(t, []int64{2}, pgtest.Column[int64](t, db, `SELECT count(*) FROM millwright_parked_messages`))

	status, body = b.post(t, "/parked/action", tok, form("step", "confirm", "head", strconv.FormatInt(head, 10), "consumer_group", "ledger-group"))
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `id="done"`)
	require.Equal(t, []string{"m2"}, pgtest.Column[string](t, db, `SELECT convert_from(message_uuid, 'UTF8') FROM millwright_parked_messages`))
	require.Equal(t, []string{"m1 skipped ledger-group ledger timeout after 30s"},
		pgtest.Column[string](t, db, `SELECT message_uuid || ' ' || reason || ' ' || consumer_group || ' ' || error FROM millwright_dead_letters`))
	require.Equal(t, []int64{1}, pgtest.Column[int64](t, db, `SELECT count(*) FROM millwright_audit WHERE command = 'console parked skip'`))
}
