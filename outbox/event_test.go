package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
)

// Values are written as quoted literals: awkward content must round-trip
// exactly, and what Postgres cannot store must be refused by name.
func TestAdd_AwkwardValuesRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t)
	got := b.collect(t, "it's")
	ctx := context.Background()
	tricky := `x'); DROP TABLE millwright_outbox; -- \ \\ "` + "é\u2028"
	evs := []Event{
		{Topic: "it's", AggregateID: tricky, Payload: []byte(`{"s": "` + `\\'` + `"}`), Metadata: map[string]string{"k'\\": tricky}},
		{Topic: "it's", AggregateID: "a", Payload: []byte(`{"nul": "\u0000"}`)},                  // JSON that JSONB refuses: kept as bytes
		{Topic: "it's", AggregateID: "a", Payload: []byte{0, 1, 2, '\\', '\'', 0xff}},            // binary
		{Topic: "it's", AggregateID: "a", Payload: []byte(` {"spaced" : 1} `), RawPayload: true}, // byte-exact JSON
	}
	for i := range evs {
		evs[i].ID = fmt.Sprint("ev-", i)
	}
	require.NoError(t, Add(ctx, b.db, evs...))
	startRelay(t, b.db, b.pubsub, RelayConfig{PollInterval: 10 * time.Millisecond})
	eventually(t, 5*time.Second, func() bool { return len(got.all()) == 4 }, "4 messages")
	// Different aggregates go out in parallel: look messages up by id.
	byID := map[string]*message.Message{}
	for _, m := range got.all() {
		byID[m.UUID] = m
	}
	msgs := make([]*message.Message, len(evs))
	for i := range evs {
		msgs[i] = byID[evs[i].ID]
		require.NotNil(t, msgs[i], evs[i].ID)
	}
	require.Equal(t, tricky, msgs[0].Metadata.Get(metadata.AggregateID))
	require.Equal(t, tricky, msgs[0].Metadata.Get("k'\\"))
	require.JSONEq(t, string(evs[0].Payload), string(msgs[0].Payload))
	for i := 1; i < 4; i++ {
		require.Equal(t, evs[i].Payload, []byte(msgs[i].Payload), "payload %d byte for byte", i)
	}

	err := Add(ctx, b.db, Event{Topic: "t", AggregateID: "a", Metadata: map[string]string{"k": "a\x00b"}})
	require.ErrorIs(t, err, ErrInvalidEvent)
	require.ErrorContains(t, err, "NUL")
	require.ErrorIs(t, Add(ctx, b.db, Event{Topic: "t\x00", AggregateID: "a"}), ErrInvalidEvent)
}
