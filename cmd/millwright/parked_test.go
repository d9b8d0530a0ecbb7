package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
)

// seedParked parks two keys of handler billing: "held" (held behind dead
// letter 7, one message behind) and "due" (being retried, alone). A key
// column holds the key's lane: the tag 'k', then the key's bytes.
func seedParked(t *testing.T) *pgtest.Schema {
	t.Helper()
	s := pgtest.New(t, dlq.Migrations(), park.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	for _, q := range []string{
		`INSERT INTO millwright_parked_keys (handler, key, due_at, held, attempts, rounds, first_failure_at, last_failure_at, last_error, dead_letter_id)
			VALUES ('billing', 'kheld', now(), true, 12, 5, now() - interval '1 hour', now(), 'payment provider down', 7),
			       ('billing', 'kdue', now() + interval '1 minute', false, 2, 0, now(), now(), 'timeout', NULL)`,
		`INSERT INTO millwright_parked_messages (handler, key, message_uuid, topic, payload)
			VALUES ('billing', 'kheld', 'm1', 'orders', ''), ('billing', 'kheld', 'm2', 'orders', ''), ('billing', 'kdue', 'm3', 'orders', '')`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err, q)
	}
	return s
}

func parkedMessages(t *testing.T, s *pgtest.Schema) string {
	t.Helper()
	var got string
	require.NoError(t, s.DB.QueryRow(`SELECT coalesce(string_agg(convert_from(substr(key, 2), 'UTF8') || ':' || convert_from(message_uuid, 'UTF8'), ',' ORDER BY id), '') FROM millwright_parked_messages`).Scan(&got))
	return got
}

func TestParkedListRetryRelease(t *testing.T) {
	t.Parallel()
	s := seedParked(t)
	out, _, err := runCLI(t, parkedCmd(), nil, s.URL, "list")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 3, out)
	require.Contains(t, lines[1], "held (dead letter 7)", "held keys first")
	require.Contains(t, lines[1], "payment provider down")
	require.Contains(t, lines[2], "timeout")

	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "list", "--json", "--handler", "billing")
	require.NoError(t, err)
	var rows []parkedRow
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var r parkedRow
		require.NoError(t, json.Unmarshal([]byte(l), &r), l)
		rows = append(rows, r)
	}
	require.Len(t, rows, 2)
	require.Equal(t, parkedRow{Handler: "billing", Key: "held", Messages: 2, Held: true, Attempts: 12, Rounds: 5, LastError: "payment provider down",
		DeadLetterID: 7, FirstFailure: rows[0].FirstFailure, LastFailure: rows[0].LastFailure, ParkedSince: rows[0].ParkedSince}, rows[0])
	require.Nil(t, rows[0].DueAt, "a held key has no due time")
	require.NotNil(t, rows[1].DueAt)

	before := parkedMessages(t, s)
	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "release", "held")
	require.ErrorIs(t, err, errNeedsYes)
	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "release", "due", "--yes")
	require.ErrorContains(t, err, "not held")
	require.ErrorContains(t, err, "--force")
	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "release", "held", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run: would drop the head of key \"held\" of handler \"billing\" and go on with its 1 later message(s)")
	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "retry", "nope", "--yes")
	require.ErrorIs(t, err, park.ErrNotParked)
	require.Equal(t, before, parkedMessages(t, s), "refused, failed and dry runs change nothing")

	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "release", "held", "--yes")
	require.NoError(t, err)
	require.Equal(t, "held:m2,due:m3", parkedMessages(t, s), "the held head dropped, its next message stays")
	var held bool
	require.NoError(t, s.DB.QueryRow(`SELECT held FROM millwright_parked_keys WHERE key = 'kheld'`).Scan(&held))
	require.False(t, held, "the key goes on")

	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "retry", "due", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "done: run the head of key \"due\"")
	var due bool
	require.NoError(t, s.DB.QueryRow(`SELECT due_at <= now() AND attempts = 0 FROM millwright_parked_keys WHERE key = 'kdue'`).Scan(&due))
	require.True(t, due)

	var cmds []string
	for _, e := range auditRows(t, s) {
		cmds = append(cmds, e.Command+" "+strings.Join(e.Args, " ")+" error="+e.Error)
	}
	require.Len(t, cmds, 5, "every run past flag checks is audited: %v", cmds)
}

// A binary key is listed as hex:... and given back with --hex; a message
// parked without a key is listed as (no key) UUID and given with --no-key,
// apart from a real key of any text.
func TestParkedBinaryAndKeylessKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), park.Migrations(), audit.Migrations())
	for _, q := range []string{
		`INSERT INTO millwright_parked_keys (handler, key, due_at) VALUES
			('billing', '\x6b0aff01'::bytea, now() + interval '1 hour'), ('billing', '\x6b0afe01'::bytea, now() + interval '1 hour'),
			('billing', 'un1', now() + interval '1 hour'), ('billing', 'kuuid:n1', now() + interval '1 hour')`,
		`INSERT INTO millwright_parked_messages (handler, key, message_uuid, payload) VALUES
			('billing', '\x6b0aff01'::bytea, 'b1', ''), ('billing', '\x6b0afe01'::bytea, 'b2', ''), ('billing', 'un1', 'n1', ''), ('billing', 'kuuid:n1', 'r1', '')`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err, q)
	}
	out, _, err := runCLI(t, parkedCmd(), nil, s.URL, "list")
	require.NoError(t, err)
	require.Contains(t, out, "hex:0aff01")
	require.Contains(t, out, "hex:0afe01")
	require.Contains(t, out, "(no key) n1")
	require.Contains(t, out, "uuid:n1")

	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "list", "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"key_hex":"0aff01"`)
	require.Contains(t, out, `"key":"n1"`)
	require.Contains(t, out, `"keyless":true`)

	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "retry", "hex:0afe01", "--yes")
	require.ErrorContains(t, err, "--hex")
	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "retry", "hex:0afe01", "--hex", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, `key "\n\xfe\x01"`)
	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "retry", "n1", "--no-key", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, `(no key: message "n1")`)
	var due []string
	rows, err := s.DB.Query(`SELECT encode(key, 'hex') FROM millwright_parked_keys WHERE due_at <= now() ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		due = append(due, k)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"6b0afe01", "756e31"}, due, "exactly the binary key 0afe01 and the keyless lane of n1 were retried")
}

// `parked skip` dead-letters a head still being retried (reason skipped,
// the key's attempts and error, the consumer group given), drops it and
// goes on; a held key's head is already a dead letter and is only
// dropped. A dry run changes nothing.
func TestParkedSkipKeepsTheHeadInTheDLQ(t *testing.T) {
	t.Parallel()
	s := seedParked(t)
	before := parkedMessages(t, s)
	out, _, err := runCLI(t, parkedCmd(), nil, s.URL, "skip", "due", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, `dry run: would dead-letter the head of key "due" of handler "billing"`)
	require.Equal(t, before, parkedMessages(t, s))
	require.Equal(t, []int{0}, pgtest.Column[int](t, s.DB, `SELECT count(*)::int FROM millwright_dead_letters`))

	out, _, err = runCLI(t, parkedCmd(), nil, s.URL, "skip", "due", "--consumer-group", "billing-svc", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "the head is dead letter 1")
	require.Equal(t, "held:m1,held:m2", parkedMessages(t, s), "the head dropped; the key had no later message and is released")
	dls, err := dlq.NewStore(postgres.From(s.DB)).List(t.Context(), dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, dls, 1)
	d := dls[0]
	require.Equal(t, []any{"m3", "orders", "orders.dlq", "billing-svc", "billing", dlq.ReasonSkipped, "timeout", 2, dlq.StateDead},
		[]any{d.MessageUUID, d.OriginalTopic, d.DeadLetterTopic, d.ConsumerGroup, d.Handler, d.Reason, d.Error, d.Attempts, d.State})

	_, _, err = runCLI(t, parkedCmd(), nil, s.URL, "skip", "held", "--yes")
	require.NoError(t, err)
	require.Equal(t, "held:m2", parkedMessages(t, s), "a held head is dropped; its dead letter 7 stays where it is")
	require.Equal(t, []int{1}, pgtest.Column[int](t, s.DB, `SELECT count(*)::int FROM millwright_dead_letters`), "no second dead letter")
}
