package console_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// replayRows is what a replay leaves in a schema, without ids and times:
// the outbox rows it queued, the dead letter's state, and the audit rows
// of the dead letter (action, operator, arguments, count).
type replayRows struct {
	Outbox     []string
	DeadLetter []string
	Audit      []string
}

func readReplayRows(t *testing.T, s *pgtest.Schema) replayRows {
	t.Helper()
	return replayRows{
		Outbox: pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', event_id, topic, aggregate_type, aggregate_id, event_type,
			encode(COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), 'escape'), metadata::text, status, retry_count::text)
			FROM millwright_outbox ORDER BY id`),
		DeadLetter: pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', id::text, state, replay_count::text, replayed_at IS NOT NULL,
			COALESCE(superseded_by, '-'), COALESCE(superseded_actor, '-')) FROM millwright_dead_letters ORDER BY id`),
		Audit: pgtest.Column[string](t, s.DB, `SELECT concat_ws(' | ', os_user, command, array_to_string(args, ' '), affected::text)
			FROM millwright_audit WHERE command IN ($1, $2) ORDER BY id`, dlq.ReplayCommand, dlq.EditReplayCommand),
	}
}

// sameDeadLetter stores the same dead letter (UUID, payload, metadata,
// times) in store.
func sameDeadLetter(t *testing.T, store *dlq.Store, uuid string, at time.Time) int64 {
	t.Helper()
	msg := message.NewMessage(uuid, []byte(`{"order":7}`))
	msg.Metadata.Set(metadata.EventID, "evt-"+uuid)
	msg.Metadata.Set(metadata.AggregateType, "order")
	msg.Metadata.Set(metadata.AggregateID, "o-7")
	msg.Metadata.Set(metadata.EventType, "order.placed")
	msg.Metadata.Set(metadata.EventSource, "/orders")
	msg.Metadata.Set(metadata.TraceParent, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	msg.Metadata.Set("tenant", "acme")
	msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
	msg.Metadata.Set(metadata.DeadLetterTopic, dlq.DefaultTopic("orders"))
	msg.Metadata.Set(metadata.DeadLetterConsumerGroup, "billing")
	msg.Metadata.Set(metadata.DeadLetterHandler, "charge")
	msg.Metadata.Set(metadata.DeadLetterReason, dlq.ReasonExhausted)
	msg.Metadata.Set(metadata.DeadLetterError, "card declined")
	msg.Metadata.Set(metadata.DeadLetterAttempts, "3")
	msg.Metadata.Set(metadata.DeadLetterFirstFailure, at.Add(-time.Minute).Format(time.RFC3339Nano))
	msg.Metadata.Set(metadata.DeadLetterLastFailure, at.Format(time.RFC3339Nano))
	id, err := store.Insert(context.Background(), msg)
	require.NoError(t, err)
	return id
}

// The CLI's replay (`millwright dlq replay --id N`, which calls
// dlq.Replay) and the console's (its HTTP handler, which calls
// dlq.ReplayTx) are one function: the same dead letter, in two schemas,
// replayed one way in each, leaves identical rows: the outbox row queued,
// the dead letter's state and its audit row.
func TestCLIAndConsoleReplayAreOne(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		at := time.Now().UTC().Truncate(time.Millisecond)
		const uuid = "5b0e6a40-0000-4000-8000-000000000007"

		// The console's way: its replay form, confirmed.
		b := setupOn(t, driver)
		viaConsole := sameDeadLetter(t, b.store, uuid, at)
		status, body := b.post(t, "/dead-letters/replay", b.token(t),
			url.Values{"id": {strconv.FormatInt(viaConsole, 10)}, "action": {"replay"}})
		require.Equal(t, http.StatusOK, status, body)
		require.NotContains(t, body, `id="skipped"`)

		// The CLI's way, by the same operator.
		cli := pgtest.New(t, migrations.All()...)
		viaCLI := sameDeadLetter(t, dlq.NewStore(postgres.From(cli.DB)), uuid, at)
		require.Equal(t, viaConsole, viaCLI, "both schemas number the dead letter alike")
		rep, err := dlq.Replay(ctx, cli.Handles(t, driver), dlq.ReplayOptions{
			Filter: dlq.Filter{IDs: []int64{viaCLI}},
			By:     audit.Operator{User: testActor, Host: audit.Hostname(), Confirmed: "--yes"},
		})
		require.NoError(t, err)
		require.Len(t, rep.Items, 1)

		got, want := readReplayRows(t, b.schema), readReplayRows(t, cli)
		require.Len(t, got.Outbox, 1, "one message queued")
		require.Contains(t, got.Outbox[0], `"dlq_replay_for": "billing/charge"`)
		require.Equal(t, []string{"1 | replayed | 1 | t |  | " + testActor}, got.DeadLetter)
		require.Equal(t, []string{testActor + " | " + dlq.ReplayCommand + " | --id=1 | 1"}, got.Audit)
		require.Equal(t, want, got, "the CLI's and the console's replay leave the same rows")
	})
}
