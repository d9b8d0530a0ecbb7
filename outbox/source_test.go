package outbox

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
)

// An event written without Source or EventType, as outbox/doc.go's
// example, is stored with the default source and the topic as its type;
// one that would be invalid CloudEvents is refused at write time.
func TestPrepareMakesEveryEventValidCloudEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	row, err := defaultWriter().prepare(ctx, Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{}`)})
	require.NoError(t, err)
	var md map[string]string
	require.NoError(t, json.Unmarshal([]byte(row.Metadata), &md))
	require.Equal(t, defaultWriter().Source(), md[metadata.EventSource])
	require.NotEmpty(t, defaultWriter().Source())
	require.Equal(t, "orders", row.EventType, "event_type defaults to the topic")

	// A RawPayload JSON event carries its content type.
	row, err = defaultWriter().prepare(ctx, Event{Topic: "orders", Payload: []byte(`{"a": 1}`), RawPayload: true})
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(row.Metadata), &md))
	require.Equal(t, "application/json", md[metadata.EventDataContentType])

	for name, ev := range map[string]Event{
		"source not a URI-reference": {Topic: "orders", Source: "%zz"},
		"time not RFC 3339":          {Topic: "orders", Metadata: map[string]string{metadata.EventTime: "yesterday"}},
		"bad content type":           {Topic: "orders", Metadata: map[string]string{metadata.EventDataContentType: "json"}},
		"spec version 0.3":           {Topic: "orders", Metadata: map[string]string{metadata.EventSpecVersion: "0.3"}},
		"type with spaces":           {Topic: "orders", EventType: " order.created "},
	} {
		_, err := defaultWriter().prepare(ctx, ev)
		require.ErrorIs(t, err, ErrInvalidEvent, name)
		require.ErrorContains(t, err, "CloudEvent", name)
	}
	_, err = NewWriter(WriterConfig{Source: "%zz"})
	require.ErrorIs(t, err, ErrInvalidEvent)
	require.ErrorContains(t, err, "WriterConfig.Source")
	require.ErrorIs(t, checkSource(""), ErrInvalidEvent)
	require.ErrorContains(t, checkSource(""), EnvServiceName)
}
