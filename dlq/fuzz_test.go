package dlq

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

func isStorable(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

func hostileEnvelope(uuid, attempts, first, last, errText, key, value string, payload []byte) *message.Message {
	msg := message.NewMessage(uuid, payload)
	msg.Metadata.Set(metadata.DeadLetterOriginalTopic, "orders")
	msg.Metadata.Set(metadata.DeadLetterAttempts, attempts)
	msg.Metadata.Set(metadata.DeadLetterFirstFailure, first)
	msg.Metadata.Set(metadata.DeadLetterLastFailure, last)
	msg.Metadata.Set(metadata.DeadLetterError, errText)
	msg.Metadata.Set(key, value)
	return msg
}

// FuzzParseEnvelope reads hostile dead-letter metadata back: no panic, and
// every value it produces is one Postgres stores (a row it refused would
// be redelivered to the store forever).
func FuzzParseEnvelope(f *testing.F) {
	f.Add("u-1", "5", "2026-01-02T15:04:05Z", "2026-01-02T15:05:05.123456789+02:00", "payment declined", "ce_id", "evt-1", []byte(`{}`))
	f.Add("u\x00", "99999999999", "not a time", "", "bad\xff\x00", "k\x00", "v\xfe", []byte("\x00\xff"))
	f.Add("", "-3", "0000-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "", "", "", []byte(nil))
	f.Add("u-3", "1", "0000-01-01T00:00:00-23:59", "2026-01-02T15:04:05.999999999+23:59", "", "", "", []byte(nil))
	f.Add("u-2", " 7 ", "2026-01-02T15:04:05Z", "2026-01-02T15:04:04Z", strings.Repeat("é", 600), "dlq_reason", "spoofed", []byte("x"))
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f.Fuzz(func(t *testing.T, uuid, attempts, first, last, errText, key, value string, payload []byte) {
		r, err := parseEnvelope(hostileEnvelope(uuid, attempts, first, last, errText, key, value, payload), "orders.dlq", now)
		if err != nil {
			t.Fatalf("refused an envelope (it would be redelivered forever): %v", err)
		}
		for name, s := range map[string]string{"uuid": r.row().MessageUUID, "topic": r.OriginalTopic, "dlq topic": r.DeadLetterTopic,
			"error": r.Error, "metadata": r.metadataJSON} {
			if !isStorable(s) {
				t.Fatalf("%s %q cannot be stored", name, s)
			}
		}
		if strings.Contains(r.metadataJSON, `\u0000`) {
			t.Fatalf("metadata JSON %s holds a NUL escape: jsonb refuses it", r.metadataJSON)
		}
		if !json.Valid([]byte(r.metadataJSON)) {
			t.Fatalf("metadata JSON %s is not valid", r.metadataJSON)
		}
		if r.Attempts < 0 || r.Attempts > maxAttempts {
			t.Fatalf("attempts %d out of the column's range", r.Attempts)
		}
		if r.FirstFailure.IsZero() || r.LastFailure.IsZero() {
			t.Fatal("zero failure time")
		}
		for name, at := range map[string]time.Time{"first failure": r.FirstFailure, "last failure": r.LastFailure} {
			if err := storage.CheckTime(at); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		for name, s := range map[string]string{"uuid": r.row().MessageUUID, "topic": r.OriginalTopic, "dlq topic": r.DeadLetterTopic,
			"consumer group": r.ConsumerGroup, "handler": r.Handler, "reason": r.Reason, "error": r.Error,
			"error type": r.ErrorType, "stack": r.Stack, "metadata": r.metadataJSON} {
			if err := storage.CheckText(s); err != nil {
				t.Fatalf("%s: the storage layer refuses it: %v", name, err)
			}
		}
		if string(r.Payload) != string(payload) {
			t.Fatal("payload changed")
		}
		if r.MessageUUID != uuid || r.row().MessageUUIDRaw != uuid {
			t.Fatalf("uuid %q kept as %q: a replay publishes it byte for byte", uuid, r.MessageUUID)
		}
		if !isDeadLetterKey(key) && r.Metadata[key] != value {
			t.Fatalf("metadata %q = %q kept as %q: a replay publishes it byte for byte", key, value, r.Metadata[key])
		}
		if md, err := storage.DecodeParkedMetadata(r.row().MetadataRaw); err != nil || len(md) != len(r.Metadata) || (!isDeadLetterKey(key) && md[key] != value) {
			t.Fatalf("metadata_raw does not decode to the metadata: %v", err)
		}
		for k := range r.Metadata {
			if isDeadLetterKey(k) {
				t.Fatalf("dead-letter key %q kept in the original metadata", k)
			}
		}
	})
}

// TestHostileEnvelopeIsStored proves the fuzzer's rule on the real table:
// an envelope with NUL bytes, invalid UTF-8 and an out-of-range attempt
// count is stored, not refused.
func TestHostileEnvelopeIsStored(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, Migrations())
	s.DB.SetMaxOpenConns(2)
	store := NewStore(postgres.From(s.DB))
	msg := hostileEnvelope("u\x00-1", "99999999999", "2026-01-02T15:04:05Z", "x", "bad\xff\x00text", "k\x00", "v\xfe", []byte("\x00\xffbin"))
	msg.Metadata.Set(metadata.DeadLetterTopic, "orders.dlq")
	id, err := store.Insert(context.Background(), msg)
	require.NoError(t, err)
	d, err := store.Get(context.Background(), id)
	require.NoError(t, err)
	require.Equal(t, maxAttempts, d.Attempts)
	require.Equal(t, "bad\uFFFD\uFFFDtext", d.Error)
	require.Equal(t, "u\x00-1", d.MessageUUID, "the UUID kept byte for byte (message_uuid_raw)")
	require.Equal(t, "v\xfe", d.Metadata["k\x00"], "metadata kept byte for byte (metadata_raw)")
	require.Equal(t, []byte("\x00\xffbin"), d.Payload, "payload kept byte for byte")
}
