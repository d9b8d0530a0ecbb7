package park_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/park"
)

// Skipping a key whose head is still retried dead-letters the head (with
// the key's attempts and last error, and the consumer given), drops it
// and goes on with the key's later messages in order; the head is never
// applied, and its dead letter waits for a replay. Skipping a key that
// is not parked is ErrNotParked and changes nothing.
func TestSkipDeadLettersTheHeadAndGoesOn(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		b := setup(t, driver)
		a := newApp()
		p := b.parker(t, park.Config{ConsumerGroup: "billing-svc", Retry: patient})
		h := chain(t, p, "billing", a.handle)
		a.fail("a1")
		deliver(t, h, msg("a1", "a"))
		deliver(t, h, msg("a2", "a"))
		ks := b.keys(t)
		require.Len(t, ks, 1)
		require.False(t, ks[0].Held, "still retried: no dead letter yet")

		_, err := b.store.Skip(ctx, park.Key{Handler: "billing", Key: "nope"}, park.SkipOptions{})
		require.ErrorIs(t, err, park.ErrNotParked)

		id, err := b.store.Skip(ctx, ks[0], park.SkipOptions{ConsumerGroup: "billing-svc"})
		require.NoError(t, err)
		d, err := b.dlq.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, []any{"a1", "billing-svc", "billing", dlq.ReasonSkipped, 2, dlq.StateDead},
			[]any{d.MessageUUID, d.ConsumerGroup, d.Handler, d.Reason, d.Attempts, d.State})
		require.Contains(t, d.Error, "database unavailable", "the head's last error")
		require.Equal(t, "a", d.Metadata[metadata.OrderingKey], "the message's metadata byte for byte")

		b.drain(t, p, nil)
		require.Equal(t, []string{"a2"}, a.appliedList(), "the key went on without its head")
		require.Equal(t, 2, a.callsOf("a1"), "the skipped head never ran again")
	})
}
