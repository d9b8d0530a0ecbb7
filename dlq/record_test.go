package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

// RecordTx (package park's route) and the dead-letter topic's recorder
// (Store.Record) write one dead letter alike, every column: the same
// failure recorded both ways, in two schemas, gives identical rows, text
// Postgres refuses and binary metadata included. RecordTx commits and
// rolls back with its transaction.
func TestRecordTxWritesLikeTheRecorder(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		last := time.Now().UTC().Truncate(time.Microsecond)
		msg := deadLetter("orders", "boom \xff\x00 bad", last)
		msg.Metadata.Set("bin\xfe", "v\x00\xff")
		msg.Metadata.Set(metadata.DeadLetterStack, "goroutine 1\x00")

		viaTopic, _ := newStoreOn(t, driver)
		_, err := viaTopic.Insert(ctx, msg)
		require.NoError(t, err)

		s := pgtest.New(t, dlq.Migrations())
		db := s.Handles(t, driver)
		d := dlq.DeadLetter{
			MessageUUID: msg.UUID, OriginalTopic: "orders", DeadLetterTopic: dlq.DefaultTopic("orders"),
			ConsumerGroup: "billing", Handler: "h", Reason: dlq.ReasonExhausted, Error: "boom \xff\x00 bad",
			ErrorType: "*errors.errorString", Stack: "goroutine 1\x00", Attempts: 5,
			FirstFailure: last.Add(-time.Second), LastFailure: last, Payload: msg.Payload, Metadata: map[string]string{},
		}
		for k, v := range msg.Metadata {
			if k == metadata.EventID || k == metadata.TraceParent || k == "bin\xfe" || k == metadata.DeadLetterOriginalMessageID {
				d.Metadata[k] = v
			}
		}
		errRollback := context.Canceled
		require.ErrorIs(t, db.InTx(ctx, func(tx postgres.Tx) error {
			_, err := dlq.RecordTx(ctx, tx, d)
			require.NoError(t, err)
			return errRollback
		}), errRollback)
		require.Zero(t, pgtest.Column[int](t, s.DB, `SELECT count(*)::int FROM millwright_dead_letters`)[0], "rolled back with its transaction")
		require.NoError(t, db.InTx(ctx, func(tx postgres.Tx) error {
			id, err := dlq.RecordTx(ctx, tx, d)
			require.NotZero(t, id)
			return err
		}))

		const row = `SELECT concat_ws(' | ', message_uuid, encode(message_uuid_raw, 'hex'), original_topic, dlq_topic, consumer_group, handler,
			reason, error, error_type, stack, attempts::text, first_failure_at::text, last_failure_at::text, encode(payload, 'hex'),
			metadata::text, encode(metadata_raw, 'hex'), state, replay_count::text) FROM millwright_dead_letters`
		want := pgtest.Column[string](t, handlesOf(t, viaTopic).schema.DB, row)
		require.Len(t, want, 1)
		require.Equal(t, want, pgtest.Column[string](t, s.DB, row))
	})
}
