package dlq_test

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// binary is bytes a Kafka key or header may carry that are not text: a
// newline, an invalid UTF-8 byte, a control byte and NUL.
const binary = "\x0a\xff\x01\x00"

// A Kafka message with a binary key (metadata.OrderingKey), a binary
// header (key and value) and a binary UUID fails, is dead-lettered and
// recorded from the dead-letter topic with every byte (issue 40), on both
// drivers. Replays go through the outbox, whose metadata is text, so its
// replay is refused with ErrNotReplayable instead of sending other bytes.
func TestBinaryKeyedDeadLetterKeepsItsBytesAndIsNotReplayedChanged(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		store, _ := newStoreOn(t, driver)
		tr, err := transport.Open(ctx, transporttest.Config(t, transport.Kafka))
		require.NoError(t, err)
		t.Cleanup(func() { _ = tr.Close() })
		topic := fmt.Sprintf("binkey_%s_%s", driver, watermill.NewShortUUID())
		dlTopic := dlq.DefaultTopic(topic)

		sub, err := tr.Subscriber("svc")
		require.NoError(t, err)
		rec, err := tr.Subscriber("recorder")
		require.NoError(t, err)
		for _, s := range []struct {
			sub   message.Subscriber
			topic string
		}{{sub, topic}, {rec, dlTopic}} {
			if si, ok := s.sub.(message.SubscribeInitializer); ok {
				require.NoError(t, si.SubscribeInitialize(s.topic))
			}
		}
		mw, err := dlq.NewMiddleware(tr.Publisher(), dlq.Config{ConsumerGroup: "svc", Retry: retry.Policy{MaxAttempts: 1}})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		var failed atomic.Int64
		replayed := make(chan *message.Message, 4)
		router.AddConsumerHandler("svc-"+topic, topic, sub, func(msg *message.Message) error {
			if msg.Metadata.Get(metadata.DeadLetterReplayOf) == "" {
				failed.Add(1)
				return failure.Permanent(fmt.Errorf("message %q fails until replayed", msg.UUID))
			}
			replayed <- msg.Copy()
			return nil
		}).AddMiddleware(mw.Middleware)
		router.AddConsumerHandler("recorder-"+topic, dlTopic, rec, store.Record)
		dlqtest.RunRouter(ctx, t, router)

		uuid := binary + "-" + watermill.NewUUID()
		orig := message.NewMessage(uuid, []byte(`{"order":1}`))
		orig.Metadata.Set(metadata.OrderingKey, "key"+binary)
		orig.Metadata.Set("header"+binary, "value"+binary)
		orig.Metadata.Set("text", "plain é")
		require.NoError(t, tr.Publisher().Publish(topic, orig))

		var dls []dlq.DeadLetter
		poll.Until(t, 2*time.Minute, func() bool {
			dls, err = store.List(ctx, dlq.Filter{Topic: topic})
			require.NoError(t, err)
			return len(dls) == 1
		}, "the dead letter of %q is recorded", uuid)
		require.EqualValues(t, 1, failed.Load(), "the original failed once, then was dead-lettered")

		// The outbox's metadata is text (JSONB): a replay would reach the
		// consumer with other bytes, so it is refused, naming the row, and
		// nothing is queued or marked.
		_, err = replay(t, ctx, store, dlq.ReplayOptions{Filter: dlq.Filter{Topic: topic}})
		require.ErrorIs(t, err, dlq.ErrNotReplayable)
		require.ErrorContains(t, err, fmt.Sprintf("dead letter %d", dls[0].ID))
		require.Empty(t, queued(t, store))
		d, err := store.Get(ctx, dls[0].ID)
		require.NoError(t, err)
		require.Equal(t, dlq.StateDead, d.State)
		require.Equal(t, uuid, d.MessageUUID, "dlq list and show read the UUID's bytes")
		for k, v := range orig.Metadata {
			require.Equal(t, v, d.Metadata[k], "metadata %q is kept byte for byte", k)
		}
		select {
		case got := <-replayed:
			t.Fatalf("nothing was replayed, yet %q reached the consumer", got.UUID)
		default:
		}
	})
}

// Migration 005 gives the dead letters recorded before it their lossless
// copies (the bytes their text kept), which replay and Get then read; a
// row an older version writes after it (no raw columns) is read from its
// text.
func TestMigrationKeepsDeadLetters(t *testing.T) {
	t.Parallel()
	files := fstest.MapFS{}
	for _, name := range []string{"001_dead_letters.sql", "002_retention.sql", "003_superseded.sql", "004_resolved.sql"} {
		b, err := os.ReadFile("migrations/" + name)
		require.NoError(t, err)
		files["m/"+name] = &fstest.MapFile{Data: b}
	}
	s := pgtest.New(t, migrate.Embedded("dlq", files, "m"), outbox.Migrations(), audit.Migrations())
	ctx := context.Background()
	const insertOld = `INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, first_failure_at, last_failure_at, payload, metadata)
VALUES ($1, 'orders', 'orders.dlq', now(), now(), 'p', $2::jsonb) RETURNING id`
	var before int64
	require.NoError(t, s.DB.QueryRowContext(ctx, insertOld, "u-before", `{"ordering_key": "order/1", "q": "it's \"é\"", "empty": ""}`).Scan(&before))

	_, err := migrate.Up(ctx, postgres.From(s.DB), dlq.Migrations())
	require.NoError(t, err)

	var hasRaw bool
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT message_uuid_raw IS NOT NULL AND metadata_raw IS NOT NULL FROM millwright_dead_letters WHERE id = $1`, before).Scan(&hasRaw))
	require.True(t, hasRaw, "the migration converts the existing row")
	var after int64
	require.NoError(t, s.DB.QueryRowContext(ctx, insertOld, "u-after", `{"k": "v"}`).Scan(&after))

	store := dlq.NewStore(postgres.From(s.DB))
	stores.Store(store, storeOf{db: postgres.SQL(s.DB), schema: s})
	want := map[int64]dlq.DeadLetter{
		before: {MessageUUID: "u-before", Metadata: map[string]string{"ordering_key": "order/1", "q": `it's "é"`, "empty": ""}},
		after:  {MessageUUID: "u-after", Metadata: map[string]string{"k": "v"}},
	}
	for id, w := range want {
		d, err := store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, w.MessageUUID, d.MessageUUID)
		require.Equal(t, w.Metadata, d.Metadata)
	}
	rep, err := replay(t, ctx, store, dlq.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Items, 2)
	for _, p := range queued(t, store) {
		id := p.msg.Metadata.Get(metadata.DeadLetterReplayOf)
		w := want[map[string]int64{fmt.Sprint(before): before, fmt.Sprint(after): after}[id]]
		require.Equal(t, w.MessageUUID, p.msg.UUID, "no event id recorded: the UUID is the replay's event id")
		for k, v := range w.Metadata {
			require.Equal(t, v, p.msg.Metadata.Get(k), "metadata %q of dead letter %s", k, id)
		}
		delete(p.msg.Metadata, metadata.EventSource) // the outbox's default source
		require.Len(t, p.msg.Metadata, len(w.Metadata)+2, "the original metadata, the replay's id and the event id")
	}
}
