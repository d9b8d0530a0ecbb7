package main

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// `dlq list` and `dlq show` print a dead letter's binary UUID, key and
// header quoted, their bytes visible ("\n\xff\x01\x00"), not replaced with
// U+FFFD nor written raw to the terminal.
func TestDLQShowsBinaryMetadataQuoted(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	const binary = "\x0a\xff\x01\x00"
	uuid := binary + watermill.NewUUID()
	msg := message.NewMessage(uuid, []byte(`{}`))
	msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "bin")
	msg.Metadata.Set(metadata.DeadLetterLastFailure, time.Now().Format(time.RFC3339Nano))
	msg.Metadata.Set(metadata.OrderingKey, "key"+binary)
	msg.Metadata.Set("header"+binary, "value"+binary)
	msg.Metadata.Set("text", "plain é")
	id, err := dlq.NewStore(postgres.From(s.DB)).Insert(context.Background(), msg)
	require.NoError(t, err)

	out, err := runDLQ(t, s.URL, "show", strconv.FormatInt(id, 10))
	require.NoError(t, err)
	require.Contains(t, out, strconv.Quote(uuid))
	require.Contains(t, out, `ordering_key: "key\n\xff\x01\x00"`)
	require.Contains(t, out, `"header\n\xff\x01\x00": "value\n\xff\x01\x00"`)
	require.Contains(t, out, "text: plain é", "text is printed as it is")
	require.NotContains(t, out, "\uFFFD")

	out, err = runDLQ(t, s.URL, "list", "--topic", "bin")
	require.NoError(t, err)
	require.Contains(t, out, strconv.Quote(uuid))
}
