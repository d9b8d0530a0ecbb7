package main

import (
	"context"
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

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// oneDeadLetter stores the same dead letter (UUID, payload, metadata,
// times) in s and returns its id.
func oneDeadLetter(t *testing.T, s *pgtest.Schema, at time.Time) int64 {
	t.Helper()
	msg := message.NewMessage("5b0e6a40-0000-4000-8000-000000000007", []byte(`{"order":7}`))
	for k, v := range map[string]string{
		metadata.EventID: "evt-7", metadata.AggregateType: "order", metadata.AggregateID: "o-7", metadata.EventType: "order.placed",
		metadata.EventSource: "/orders", metadata.TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme",
		metadata.DeadLetterOriginalTopic: "orders", metadata.DeadLetterTopic: "orders.dlq", metadata.DeadLetterConsumerGroup: "billing",
		metadata.DeadLetterHandler: "charge", metadata.DeadLetterReason: dlq.ReasonExhausted, metadata.DeadLetterError: "card declined",
		metadata.DeadLetterAttempts: "3", metadata.DeadLetterFirstFailure: at.Add(-time.Minute).Format(time.RFC3339Nano),
		metadata.DeadLetterLastFailure: at.Format(time.RFC3339Nano),
	} {
		msg.Metadata.Set(k, v)
	}
	id, err := dlq.NewStore(postgres.From(s.DB)).Insert(context.Background(), msg)
	require.NoError(t, err)
	return id
}

// replayRowsOf is what a replay leaves in s, without ids and times: the
// outbox rows, the dead letter's state and its audit rows (operator,
// action, arguments, count).
func replayRowsOf(t *testing.T, s *pgtest.Schema) [3][]string {
	t.Helper()
	return [3][]string{
		pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', event_id, topic, aggregate_type, aggregate_id, event_type,
			encode(COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), 'escape'), metadata::text, status, retry_count::text)
			FROM millwright_outbox ORDER BY id`),
		pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', id::text, state, replay_count::text, replayed_at IS NOT NULL,
			COALESCE(superseded_by, ''), COALESCE(superseded_actor, '')) FROM millwright_dead_letters ORDER BY id`),
		pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', os_user, command, array_to_string(args, ' '), affected::text)
			FROM millwright_audit WHERE command IN ($1, $2) ORDER BY id`, dlq.ReplayCommand, dlq.EditReplayCommand),
	}
}

var consoleCSRF = regexp.MustCompile(`<meta name="millwright-csrf" content="([^"]+)">`)

// consoleReplay replays dead letter id of s with the console's replay
// form, as operator, on driver's pool.
func consoleReplay(t *testing.T, s *pgtest.Schema, driver, operator string, id int64) {
	t.Helper()
	cfg := console.Config{
		Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return operator, true },
		Schemas:      []string{s.Name},
	}
	h, err := console.New(s.Handles(t, driver), cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, Timeout: 30 * time.Second}
	resp, err := client.Get(srv.URL + "/dead-letters")
	require.NoError(t, err)
	page, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	m := consoleCSRF.FindSubmatch(page)
	require.NotNil(t, m, "no CSRF token on the dead-letters page")
	form := url.Values{"id": {strconv.FormatInt(id, 10)}, "action": {"replay"}, "csrf": {string(m[1])}}
	resp, err = client.Post(srv.URL+"/dead-letters/replay", "application/x-www-form-urlencoded", strings.NewReader(form.Encode()))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	require.NotContains(t, string(body), `id="skipped"`)
}

// The CLI's replay and the console's are one function (dlq.ReplayTx): the
// same dead letter, in two schemas, replayed by `millwright dlq replay
// --id N` in one and the console's replay form in the other, by the same
// operator, leaves identical rows: the outbox row queued, the dead
// letter's state and its audit row. On both drivers.
func TestCLIAndConsoleReplayLeaveTheSameRows(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		at := time.Now().UTC().Truncate(time.Millisecond)
		viaCLI, viaConsole := pgtest.New(t, migrations.All()...), pgtest.New(t, migrations.All()...)
		id := oneDeadLetter(t, viaCLI, at)
		require.Equal(t, id, oneDeadLetter(t, viaConsole, at))

		cmd := dlqCmd()
		addDriverFlag(cmd)
		out, errOut, err := runCLI(t, cmd, nil, viaCLI.URL, "replay", "--id", strconv.FormatInt(id, 10), "--yes", "--driver", driver)
		require.NoError(t, err, "%s%s", out, errOut)
		require.Contains(t, out, "queued 1 message(s)")
		require.Contains(t, errOut, "no relay is running", "the operator is told the replay waits for a relay")
		consoleReplay(t, viaConsole, driver, audit.CurrentUser(), id)

		cli, con := replayRowsOf(t, viaCLI), replayRowsOf(t, viaConsole)
		require.Len(t, cli[0], 1, "one message queued")
		require.Contains(t, cli[0][0], `"dlq_replay_for": "billing/charge"`)
		require.Equal(t, []string{"1 | replayed | 1 | t |  | " + audit.CurrentUser()}, cli[1])
		require.Equal(t, []string{audit.CurrentUser() + " | " + dlq.ReplayCommand + " | --id=1 | 1"}, cli[2])
		require.Equal(t, cli, con, "outbox rows, dead-letter state and audit rows")
	})
}
