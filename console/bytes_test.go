package console_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
)

// A dead letter whose Kafka key and header are bytes that are not text
// (newline, 0xff, 0x01, NUL) is shown with its bytes quoted, and the
// console, which replays through the outbox (text metadata), refuses to
// replay it, naming the header and `millwright dlq replay` (which
// publishes the bytes): nothing is queued, the row stays dead. It used to
// queue the message with U+FFFD in place of the bytes, and the consumer
// received another key and headers (issue 40).
func TestBinaryDeadLetterIsShownQuotedAndNotReplayedChanged(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupOn(t, driver)
		const binary = "\x0a\xff\x01\x00"
		msg := message.NewMessage(binary+watermill.NewUUID(), []byte(`{"n":1}`))
		msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "bin")
		msg.Metadata.Set(metadata.DeadLetterError, "boom")
		msg.Metadata.Set(metadata.DeadLetterLastFailure, time.Now().UTC().Format(time.RFC3339Nano))
		msg.Metadata.Set(metadata.OrderingKey, "key"+binary)
		msg.Metadata.Set("header"+binary, "value"+binary)
		id, err := b.store.Insert(context.Background(), msg)
		require.NoError(t, err)
		sid := strconv.FormatInt(id, 10)

		status, body := b.get(t, "/dead-letters/"+sid)
		require.Equal(t, http.StatusOK, status, body)
		require.Contains(t, body, `&#34;key\n\xff\x01\x00&#34;`, "the key's bytes are shown quoted")
		require.Contains(t, body, `&#34;header\n\xff\x01\x00&#34;`, "so are the header's")
		require.Contains(t, body, `&#34;\n\xff\x01\x00`, "and the UUID's")
		require.NotContains(t, body, "\uFFFD", "no byte is shown replaced")

		tok := b.token(t)
		for _, c := range []struct{ path string }{{"/dead-letters/replay"}, {"/dead-letters/" + sid + "/edit"}} {
			form := url.Values{"id": {sid}, "action": {"replay"}, "encoding": {"text"}, "payload": {`{"n":2}`}}
			status, body = b.post(t, c.path, tok, form)
			require.Equal(t, http.StatusBadRequest, status, "%s: %s", c.path, body)
			require.Contains(t, body, `metadata &#34;header\n\xff\x01\x00&#34; is not UTF-8 text`, c.path)
			require.Contains(t, body, "millwright parked retry", c.path)
		}
		require.Empty(t, b.outboxPayloads(t, "bin"), "nothing was queued")
		require.Equal(t, dlq.StateDead, b.state(t, id))
		d, err := b.store.Get(context.Background(), id)
		require.NoError(t, err)
		require.Equal(t, "value"+binary, d.Metadata["header"+binary], "the stored bytes are intact")
	})
}
