package outbox

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// Metadata that is not UTF-8 text is refused by Add and TxPublisher.Publish
// with ErrInvalidEvent naming the key and the fix, and nothing is stored:
// the JSONB column turned its bytes into U+FFFD (two such keys into one),
// so the relay published other headers than the application wrote (issue
// 40).
func TestAdd_RefusesMetadataThatIsNotUTF8(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupDriver(t, driver)
		ctx := context.Background()
		for _, c := range []struct {
			md   map[string]string
			says string
		}{
			{map[string]string{"ok": "text", "key\x0a\xff\x01": "v"}, `metadata key "key\n\xff\x01" is not valid UTF-8`},
			{map[string]string{"header": "value\x0a\xff\x01"}, `metadata "header": its value is not valid UTF-8`},
		} {
			err := AddOutsideTx(ctx, b.pdb, Event{Topic: "utf8", AggregateID: "a", Metadata: c.md})
			require.ErrorIs(t, err, ErrInvalidEvent)
			require.ErrorContains(t, err, c.says)
			require.ErrorContains(t, err, "put binary data in the payload, or base64 it")

			pub, err := NewTxPublisher(begin(t, b.handle).tx, PublisherConfig{})
			require.NoError(t, err)
			msg := message.NewMessage("m-1", []byte("{}"))
			for k, v := range c.md {
				msg.Metadata.Set(k, v)
			}
			err = pub.Publish("utf8", msg)
			require.ErrorIs(t, err, ErrInvalidEvent)
			require.ErrorContains(t, err, c.says)
		}
		require.Zero(t, pgtest.Column[int64](t, b.db, `SELECT count(*) FROM millwright_outbox`)[0], "nothing stored")
	})
}
