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

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// binary is bytes a Kafka key or header may carry that are not text: a
// newline, an invalid UTF-8 byte, a control byte and NUL.
const binary = "\x0a\xff\x01\x00"

// A Kafka message with a binary key (metadata.OrderingKey), a binary
// header (key and value) and a binary UUID fails, is dead-lettered,
// recorded from the dead-letter topic, and replayed by dlq.Store.Replay:
// its consumer receives the UUID and every metadata entry byte for byte,
// on both drivers. The dead-letter table kept them as text, with U+FFFD
// in place of the bytes, so the replay carried another key and headers
// (issue 40).
func TestBinaryKeyedDeadLetterReplaysByteForByte(t *testing.T) {
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
				return retry.Permanent(fmt.Errorf("message %q fails until replayed", msg.UUID))
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

		rep, err := store.Replay(ctx, tr.Publisher(), dlq.ReplayOptions{Filter: dlq.Filter{Topic: topic}})
		require.NoError(t, err)
		require.Len(t, rep.Items, 1)

		select {
		case got := <-replayed:
			require.Equal(t, uuid, got.UUID, "the replay carries the UUID byte for byte")
			for k, v := range orig.Metadata {
				require.Equal(t, v, got.Metadata.Get(k), "metadata %q reaches the consumer byte for byte", k)
			}
			require.Equal(t, fmt.Sprint(dls[0].ID), got.Metadata.Get(metadata.DeadLetterReplayOf))
			require.Equal(t, orig.Payload, got.Payload)
		case <-ctx.Done():
			t.Fatalf("the replay of %q did not reach its consumer", uuid)
		}
		require.Equal(t, uuid, dls[0].MessageUUID, "dlq list and show read the UUID's bytes")
		require.Equal(t, uuid, rep.Items[0].MessageUUID, "the replay report names the UUID's bytes")
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
	s := pgtest.New(t, migrate.Embedded("dlq", files, "m"))
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
	pub := &recordingPublisher{}
	rep, err := store.Replay(ctx, pub, dlq.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Items, 2)
	for _, p := range pub.published() {
		id := p.msg.Metadata.Get(metadata.DeadLetterReplayOf)
		w := want[map[string]int64{fmt.Sprint(before): before, fmt.Sprint(after): after}[id]]
		require.Equal(t, w.MessageUUID, p.msg.UUID)
		for k, v := range w.Metadata {
			require.Equal(t, v, p.msg.Metadata.Get(k), "metadata %q of dead letter %s", k, id)
		}
		require.Len(t, p.msg.Metadata, len(w.Metadata)+1, "the original metadata and the replay's id")
	}
}
